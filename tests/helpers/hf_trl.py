"""Every trainer class TRL 1.16 exports, built as a tiny job that runs one step on the CPU.

Each builder returns a fresh trainer (same seed, same weights) for one optimizer step of
m = 2, A = 2: a one-layer Llama policy from its config (``hf_jobs.causal_lm``), a second
one (other weights) as the teacher or the frozen reference where the trainer takes one,
the character tokenizer of ``hf_jobs`` with a chat template where the trainer reads
conversations, a few short texts, and for the trainers that generate a reward written
here. Nothing is downloaded. :data:`NOT_RUNNABLE` names the classes that cannot run one
step on this machine, and why (the reason a test checks).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

from helpers import hf_jobs as hj
from helpers import hf_rl

#: the chat template a conversational trainer applies: role and content, plainly
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }}.{% endfor %}"
            "{% if add_generation_prompt %}a {% endif %}")
STEP = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, bf16=False,
            learning_rate=1e-2, seed=0)
GENERATE = dict(max_completion_length=6, num_generations=2, beta=0.0)


def _tokenizer(chat: bool = False, byte_level: bool = False) -> Any:
    tok = _byte_level() if byte_level else hj.tokenizer(padding_side="left")
    if chat:
        tok.chat_template = TEMPLATE
    return tok


def _byte_level() -> Any:
    """A byte-level BPE tokenizer trained here on the texts of ``hf_jobs`` (GOLD aligns
    tokenizers by their bytes and takes no other kind): 256 bytes, a few merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    learn = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(hj.texts(32), learn)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", padding_side="left")


def _rows(kind: str) -> list[dict[str, Any]]:
    prefs = hj.preference_rows(4)
    if kind == "prompt":
        return [{"prompt": r["prompt"]} for r in prefs]
    if kind == "preference":
        return prefs
    if kind == "kto":
        return hj.kto_rows()[:4]
    if kind == "reward":
        return hj.reward_rows()[:4]
    if kind == "text":
        return [{"text": r["prompt"] + r["chosen"]} for r in prefs]
    if kind == "reference":  # TPO's triples and a gold completion
        return [{**r, "reference": r["chosen"]} for r in prefs]
    if kind == "privileged":  # SDFT: the teacher sees extra context
        return [{"prompt": r["prompt"], "privileged_context": r["chosen"]} for r in prefs]
    if kind == "messages":
        return [{"messages": [{"role": "user", "content": r["prompt"]},
                              {"role": "assistant", "content": r["chosen"]}]} for r in prefs]
    if kind == "chat_prompt":
        return [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in prefs]
    raise ValueError(kind)


def _llama(seed: int, vocab: int, head: str = "lm") -> Any:
    if head == "lm":
        return hj.causal_lm("llama", seed=seed, vocab_size=vocab)
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    return tf.LlamaForSequenceClassification(tf.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, num_labels=1, pad_token_id=hj.PAD))


def _build(module: str, trainer: str, config: str, rows: str, *, teacher: bool = False, ref: bool = False,
           reward: bool = False, chat: bool = False, byte_level: bool = False, saved: bool = False,
           head: str = "lm", config_module: str | None = None, **settings: Any) -> Callable[..., Any]:
    """``saved``: the tokenizer and the student are saved in a folder the models'
    ``_name_or_path`` names (a trainer that loads them by the model's name finds them there,
    not on a hub)."""
    def build(**args: Any) -> Any:
        import tempfile

        import datasets

        mod = importlib.import_module(module)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = hj.training_args(getattr(importlib.import_module(config_module or module), config),
                                   **{**STEP, **settings, **args})
            tok = _tokenizer(chat, byte_level)
            vocab = len(tok)
            models = {"model": _llama(0, vocab, head)}
            if teacher:
                models["teacher_model"] = _llama(1, vocab)
            if ref:
                models["ref_model"] = _llama(1, vocab)
            if saved:  # the student as built, and the tokenizer
                folder = tempfile.mkdtemp(prefix="hf_trl_")
                tok.save_pretrained(folder)
                models["model"].save_pretrained(folder)
                for m in models.values():
                    m.config._name_or_path = folder
            kw: dict[str, Any] = {**models, "args": cfg, "processing_class": tok,
                                  "train_dataset": datasets.Dataset.from_list(_rows(rows))}
            if reward:
                kw["reward_funcs"] = hf_rl.reward
            return getattr(mod, trainer)(**kw)

    build.target = f"{module}.{trainer}"  # type: ignore[attr-defined]
    return build


E = "trl.experimental."

#: name -> build(**args) -> trainer, for every trainer class TRL 1.16 exports that runs one
#: step on the CPU
TRAINERS: dict[str, Callable[..., Any]] = {
    "SFT": _build("trl", "SFTTrainer", "SFTConfig", "text", max_length=None),
    "DPO": _build("trl", "DPOTrainer", "DPOConfig", "preference", ref=True, max_length=None),
    "KTO": _build("trl", "KTOTrainer", "KTOConfig", "kto", ref=True, max_length=None),
    "Reward": _build("trl", "RewardTrainer", "RewardConfig", "reward", head="sequence", max_length=None),
    "GRPO": _build("trl", "GRPOTrainer", "GRPOConfig", "prompt", reward=True, **GENERATE),
    "RLOO": _build("trl", "RLOOTrainer", "RLOOConfig", "prompt", reward=True, **GENERATE),
    "Distillation": _build("trl", "DistillationTrainer", "DistillationConfig", "prompt", teacher=True,
                           max_completion_length=6),
    "experimental KTO": _build(E + "kto", "KTOTrainer", "KTOConfig", "kto", ref=True, max_length=None),
    "experimental Distillation": _build(E + "distillation", "DistillationTrainer", "DistillationConfig",
                                        "prompt", teacher=True, max_completion_length=6),
    "BEMA DPO": _build(E + "bema_for_ref_model", "DPOTrainer", "DPOConfig", "preference", ref=True,
                       config_module="trl", max_length=None),
    "CPO": _build(E + "cpo", "CPOTrainer", "CPOConfig", "preference", max_length=None),
    "ORPO": _build(E + "orpo", "ORPOTrainer", "ORPOConfig", "preference", max_length=None),
    "TPO": _build(E + "tpo", "TPOTrainer", "TPOConfig", "reference", max_length=None),
    "GKD": _build(E + "gkd", "GKDTrainer", "GKDConfig", "messages", teacher=True, chat=True, max_length=None,
                  max_new_tokens=6),
    "GOLD": _build(E + "gold", "GOLDTrainer", "GOLDConfig", "messages", teacher=True, chat=True,
                   byte_level=True, saved=True, max_length=None, max_completion_length=6),
    "IWOPD": _build(E + "iw_opd", "IWOPDTrainer", "IWOPDConfig", "messages", teacher=True, chat=True,
                    saved=True, max_length=64, max_completion_length=6),
    "Online DPO": _build(E + "online_dpo", "OnlineDPOTrainer", "OnlineDPOConfig", "prompt", ref=True,
                         reward=True, max_new_tokens=6, beta=0.1),
    "A2PO": _build(E + "a2po", "A2POTrainer", "A2POConfig", "prompt", reward=True, max_completion_length=6),
    "GMPO": _build(E + "gmpo", "GMPOTrainer", "GMPOConfig", "prompt", reward=True, **GENERATE),
    "SDPO": _build(E + "sdpo", "SDPOTrainer", "SDPOConfig", "chat_prompt", reward=True, chat=True, saved=True,
                   **GENERATE),
    "SDFT": _build(E + "sdft", "SDFTTrainer", "SDFTConfig", "privileged", chat=True, saved=True,
                   max_completion_length=6, num_generations=2, distillation_topk=8),
}

#: ``module.Class`` -> why it cannot run one step on the CPU of this machine (no network,
#: no server to connect to)
NOT_RUNNABLE: dict[str, str] = {
    E + "async_grpo.AsyncGRPOTrainer": "generates through a vLLM server (the rollout worker it connects to)",
    E + "async_distillation.AsyncDistillationTrainer": "generates through a vLLM server (its rollout worker)",
    E + "server_distillation.ServerDistillationTrainer": "scores with a teacher served over HTTP",
}

__all__ = ["NOT_RUNNABLE", "TRAINERS"]
