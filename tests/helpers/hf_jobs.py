"""Trainer jobs as people write them, each with the truth the audit is judged against.

Everything is built locally: tiny models from their configs (dropout 0), a character
tokenizer made in code, short English texts. No download.

The truth of a job is measured without the audit: its real first update read off the
weights (:func:`applied`: SGD at learning rate 1, constant schedule, no clipping, no
weight decay, one optimizer step, so ``w0 - w1`` is the gradient it applied), against a
reference written here by hand from the **examples**, each alone in its own row (no
padding, no packing): the summed cross-entropy of its targets, divided once by the
window's target count. Each job's window holds all its examples (``m · A`` of them), so
the sampler's order does not matter.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import hf_models

PAD, EOS, BOS, UNK, MASK = 0, 1, 2, 3, 4
CHARS = " abcdefghijklmnopqrstuvwxyz.,"
VOCAB_SIZE = 5 + len(CHARS)
M, A = 2, 4  # examples per microbatch, microbatches per window
WORDS = ("the cat sat on a mat and ran far away to see more of it while we read "
         "books by the sea when rain fell").split()

#: A real update at learning rate 1 with plain SGD: the weights move by minus the gradient.
SGD = dict(optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0,
           max_grad_norm=0.0, max_steps=1, warmup_steps=0)


def tokenizer(padding_side: str = "right") -> Any:
    """A character tokenizer: one id per character of :data:`CHARS`, and <pad> 0, <eos> 1,
    <bos> 2, <unk> 3, [MASK] 4."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, "<unk>": UNK, "[MASK]": MASK}
    vocab.update({c: i + 5 for i, c in enumerate(CHARS)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>", mask_token="[MASK]", padding_side=padding_side)


def texts(n: int = M * A, shortest: int = 40, longest: int = 90, seed: int = 0) -> list[str]:
    """``n`` texts of ``shortest`` to ``longest`` characters, words drawn at random."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        target = int(torch.randint(shortest, longest + 1, (1,), generator=g))
        words: list[str] = []
        while len(" ".join(words)) < target:
            words.append(WORDS[int(torch.randint(0, len(WORDS), (1,), generator=g))])
        out.append(" ".join(words)[:target].strip())
    return out


def token_ids(text: str, eos: bool = True) -> list[int]:
    ids = [CHARS.index(c) + 5 for c in text]
    return ids + [EOS] if eos else ids


def lm_examples(n: int = M * A, **kw: Any) -> list[dict[str, list[int]]]:
    """Tokenized texts ending in <eos>, labels implied (the collator copies input_ids)."""
    return [{"input_ids": token_ids(t)} for t in texts(n, **kw)]


# -- models from configs ---------------------------------------------------------------


def causal_lm(family: str, seed: int = 0, **config: Any) -> nn.Module:
    """A one-layer causal LM of ``family`` (gpt2, llama, opt, mixtral) from its config."""
    import transformers as tf

    common = dict(vocab_size=VOCAB_SIZE, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    if family == "gpt2":
        return hf_models.gpt2(positions=256, seed=seed, **{**common, **config})
    if family == "llama":
        cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                             **common)
        cls = tf.LlamaForCausalLM
    elif family == "opt":
        cfg = tf.OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
                           word_embed_proj_dim=16, max_position_embeddings=256, dropout=0.0,
                           attention_dropout=0.0, **common)
        cls = tf.OPTForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=256,
                               output_router_logits=True, router_aux_loss_coef=0.1, **common)
        cls = tf.MixtralForCausalLM
    else:
        raise ValueError(family)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    return cls(cfg)


def masked_lm(seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    return tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=256, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=PAD))


def seq2seq_lm(family: str, seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    if family == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB_SIZE, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
            num_heads=2, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD))
    if family == "bart":
        return tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=VOCAB_SIZE, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=256, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
            decoder_start_token_id=EOS, forced_eos_token_id=None))
    raise ValueError(family)


# -- arguments and the real update -----------------------------------------------------


def training_args(cls: Any = None, **overrides: Any) -> Any:
    """``TrainingArguments`` (or ``cls``, e.g. a TRL config) for a job of m = 2, A = 4 on the CPU."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = dict(
        per_device_train_batch_size=M, gradient_accumulation_steps=A, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    settings.update(overrides)
    return (cls or TrainingArguments)(tempfile.mkdtemp(prefix="hf_job_"), **settings)


def flat(tensors: Any) -> Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def gradient(loss: Tensor, model: nn.Module) -> Tensor:
    """``d loss / d w`` over the trainable parameters, flattened (zeros where unused)."""
    params = trainable(model)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return flat(torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True))


def applied(trainer: Any) -> tuple[Tensor, nn.Module]:
    """The gradient one real ``trainer.train()`` update applies, read off the weights
    (``trainer`` built with :data:`SGD`), and a copy of the model as it was before."""
    import copy

    start = copy.deepcopy(trainer.model)
    for module in start.modules():  # a forward patched on the instance (Accelerate's autocast,
        vars(module).pop("forward", None)  # TRL's fused head) still calls the original's
    params = trainable(trainer.model)
    before = flat(params)
    trainer.train()
    return before - flat(params), start


def compare(g: Tensor, ref: Tensor) -> tuple[float, float]:
    """``(scale, relative error)``: least-squares ``a`` in ``g ≈ a · ref`` and ``‖g − ref‖ / ‖ref‖``."""
    return float(g.dot(ref) / ref.dot(ref)), float((g - ref).norm() / ref.norm())


# -- hand-written references, each example in its own row -------------------------------


def causal_reference(model: nn.Module, rows: list[tuple[list[int], list[int]]],
                     autocast: torch.dtype | None = None) -> Tensor:
    """Token mean over the shifted targets of ``rows`` (``(input_ids, labels)``, each run
    alone): each row's summed cross-entropy of ``labels[1:]`` (not -100), one division by
    the total; under ``autocast`` (bf16) for the forward passes as a bf16 job runs them."""
    total = sum(sum(1 for x in labels[1:] if x != -100) for _, labels in rows)
    loss = 0.0
    for ids, labels in rows:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        loss = loss + F.cross_entropy(logits.float(), torch.tensor(labels[1:]), ignore_index=-100,
                                      reduction="sum")
    return gradient(loss / total, model)


def unshifted_reference(model: nn.Module, batches: list[dict[str, Tensor]]) -> Tensor:
    """Token mean over the unshifted labels (not -100) of every row of ``batches``, each
    row alone with its padding cut (masked LM; seq2seq: the encoder by its mask, the decoder
    up to its last label, decoder inputs made from the labels as the model makes them)."""
    rows = []
    for b in batches:
        for r in range(b["input_ids"].shape[0]):
            keep = b["attention_mask"][r].bool()
            labels = b["labels"][r]
            row = {"input_ids": b["input_ids"][r][keep][None]}
            if "decoder_input_ids" in b or hasattr(model, "prepare_decoder_input_ids_from_labels"):
                end = int((labels != -100).nonzero().max()) + 1
                labels = labels[:end]
                row["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=labels[None])
            else:
                labels = labels[keep]
            rows.append((row, labels))
    total = sum(int((labels != -100).sum()) for _, labels in rows)
    loss = 0.0
    for row, labels in rows:
        logits = model(**row).logits[0]
        loss = loss + F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    return gradient(loss / total, model)


class Recorder:
    """Wraps a collator and keeps what it returned (clones), for a reference built from the
    batches the run trained on (a masked-LM collator draws its masks when it collates)."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, Any]]) -> None:
        self.collate = collate
        self.batches: list[dict[str, Any]] = []

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        batch = self.collate(features)
        self.batches.append({k: v.clone() if isinstance(v, Tensor) else v for k, v in batch.items()})
        return batch


def apply_fix(report: Any, trainer: Any, **names: Any) -> Any:
    """Run ``report.fix`` as a user pastes it, in a script's namespace (``model``,
    ``trainer``, ``args``, ``train_dataset``, ``data_collator`` and ``names``), on the
    Trainer as built. Returns the Trainer."""
    namespace = {"model": trainer.model, "trainer": trainer, "args": trainer.args,
                 "train_dataset": trainer.train_dataset, "data_collator": trainer.data_collator, **names}
    exec(compile(report.fix, "<report.fix>", "exec"), namespace)
    return trainer


# -- the jobs --------------------------------------------------------------------------


def causal_rows(examples: list[dict[str, list[int]]]) -> list[tuple[list[int], list[int]]]:
    """Each example's ids with labels on every token (as a language-modelling collator sets them)."""
    return [(e["input_ids"], e.get("labels", e["input_ids"])) for e in examples]


class Job:
    """A job as a user builds it: ``build(**args)`` returns a fresh Trainer (fresh model,
    same seed) with ``args`` added to its arguments; ``reference(model, trainer)`` the
    hand-written reference at ``model``'s weights for the examples ``trainer`` trained on
    (call it after the run, with a copy of the model taken before)."""

    def __init__(self, name: str, build: Callable[..., Any], reference: Callable[[Any, Any], Tensor],
                 names: dict[str, Any] | None = None) -> None:
        self.name, self.build, self.reference = name, build, reference
        self.names = names or {}


def _sft(examples_kind: str = "text", family: str = "gpt2", peft: Any = None, **config: Any) -> Callable[..., Any]:
    def build(**args: Any) -> Any:
        import datasets
        from trl import SFTConfig, SFTTrainer

        rows = [{"text": t} for t in texts()]
        cfg = training_args(SFTConfig, **{**config, **args})
        model = causal_lm(family)
        return SFTTrainer(model=model, args=cfg, train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=tokenizer(), peft_config=peft)
    return build


def sft_reference(model: nn.Module, trainer: Any) -> Tensor:
    """The SFT job's examples (its tokenized training set), each alone, labels on every
    token, forward passes under the job's bf16 autocast when it has one."""
    rows = [(list(e["input_ids"]), list(e["input_ids"])) for e in trainer.train_dataset]
    return causal_reference(model, rows, torch.bfloat16 if trainer.args.bf16 else None)


def dft_reference(model: nn.Module, trainer: Any) -> Tensor:
    """TRL's DFT loss of the SFT job's examples, each alone: each target's negative
    log-likelihood times its probability (held constant), summed, over the target count,
    under the job's bf16 autocast."""
    total = 0
    loss = 0.0
    for e in trainer.train_dataset:
        ids = list(e["input_ids"])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(trainer.args.bf16)):
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        loss = loss + (-logp * logp.exp().detach()).sum()
        total += len(ids) - 1
    return gradient(loss / total, model)


def _plain(model: Callable[[], nn.Module], collate: Callable[..., Any], examples: Any,
           **config: Any) -> Callable[..., Any]:
    def build(**args: Any) -> Any:
        from transformers import Trainer

        return Trainer(model=model(), args=training_args(**{**config, **args}), train_dataset=examples,
                       data_collator=collate)
    return build


def jobs() -> dict[str, Job]:
    """The causal-LM and token-level jobs of the audit's matrix (docs/AUDIT.md)."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

    examples = lm_examples()
    rows = causal_rows(examples)

    def examples_reference(model: nn.Module, trainer: Any) -> Tensor:
        return causal_reference(model, rows)

    left = tokenizer("left")

    def shift_labels(features: list[Any]) -> dict[str, Tensor]:
        """Right padding, and the shifted labels supplied beside the labels (as a
        context-parallel or padding-free pipeline does; the Trainer counts them)."""
        batch = DataCollatorForLanguageModeling(tokenizer(), mlm=False)(features)
        batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        return batch

    mlm = Recorder(DataCollatorForLanguageModeling(tokenizer(), mlm=True, mlm_probability=0.3))

    def mlm_reference(model: nn.Module, trainer: Any) -> Tensor:
        return unshifted_reference(model, mlm.batches[-A:])

    def mlm_build(**args: Any) -> Any:
        from transformers import Trainer

        mlm.batches.clear()
        return Trainer(model=masked_lm(), args=training_args(**args), train_dataset=examples,
                       data_collator=mlm)

    pairs = [{"input_ids": token_ids(t[: len(t) // 2]), "labels": token_ids(t[len(t) // 2:])} for t in texts()]

    def seq2seq_collate(features: list[dict[str, list[int]]]) -> dict[str, Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        out_width = max(len(f["labels"]) for f in features)
        ids = torch.full((len(features), width), PAD)
        mask = torch.zeros_like(ids)
        labels = torch.full((len(features), out_width), -100)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[i, : len(f["input_ids"])] = 1
            labels[i, : len(f["labels"])] = torch.tensor(f["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def seq2seq_reference(model: nn.Module, trainer: Any) -> Tensor:
        return unshifted_reference(model, [seq2seq_collate(pairs)])

    def seq2seq(family: str, trainer_cls: str) -> Callable[..., Any]:
        def build(**args: Any) -> Any:
            import transformers as tf

            cls = getattr(tf, trainer_cls)
            arg_cls = tf.Seq2SeqTrainingArguments if trainer_cls == "Seq2SeqTrainer" else None
            return cls(model=seq2seq_lm(family), args=training_args(arg_cls, **args), train_dataset=pairs,
                       data_collator=seq2seq_collate)
        return build

    def lora() -> Any:
        from peft import LoraConfig

        return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True)

    def peft_gpt2() -> nn.Module:
        from peft import get_peft_model

        return get_peft_model(causal_lm("gpt2"), lora())

    out = [
        Job("sft_gpt2_bf16", _sft(), sft_reference),
        Job("sft_peft_config", _sft(peft=lora()), sft_reference),
        Job("peft_lora_gpt2", _plain(peft_gpt2, DataCollatorForLanguageModeling(tokenizer(), mlm=False), examples),
            examples_reference),
        Job("flatten_opt", _plain(lambda: causal_lm("opt"), DataCollatorWithFlattening(), examples),
            examples_reference),
        Job("flatten_llama", _plain(lambda: causal_lm("llama"), DataCollatorWithFlattening(), examples),
            examples_reference),
        Job("left_pad_llama", _plain(lambda: causal_lm("llama"),
                                     DataCollatorForLanguageModeling(left, mlm=False), examples),
            examples_reference, {"tokenizer": left}),
        Job("shift_labels_gpt2", _plain(lambda: causal_lm("gpt2"), shift_labels, examples), examples_reference),
        Job("bert_mlm", mlm_build, mlm_reference),
        Job("t5_seq2seq_trainer", seq2seq("t5", "Seq2SeqTrainer"), seq2seq_reference),
        Job("bart_trainer", seq2seq("bart", "Trainer"), seq2seq_reference),
        Job("mixtral_router", _plain(lambda: causal_lm("mixtral"),
                                     DataCollatorForLanguageModeling(tokenizer(), mlm=False), examples),
            examples_reference),
        Job("sft_dft", _sft(loss_type="dft"), dft_reference),
        Job("sft_padding_free", _sft(padding_free=True, max_length=None), sft_reference),
    ]
    return {j.name: j for j in out}


# -- jobs with their own loss: checked by split invariance ------------------------------


def preference_rows(n: int = M * A) -> list[dict[str, str]]:
    """``n`` (prompt, chosen, rejected) triples of short texts."""
    t = texts(3 * n, shortest=8, longest=24, seed=1)
    return [{"prompt": t[3 * i], "chosen": " " + t[3 * i + 1], "rejected": " " + t[3 * i + 2]} for i in range(n)]


def _trl(trainer_cls: str, config_cls: str, rows: Callable[[], list[dict[str, Any]]],
         module: str = "trl", reward: bool = False, reference: bool = False, **config: Any) -> Callable[..., Any]:
    def build(**args: Any) -> Any:
        import importlib

        import datasets

        mod = importlib.import_module(module)
        cfg = training_args(getattr(mod, config_cls), **{"bf16": False, **config, **args})
        if reward:
            model = hf_models.gpt2("sequence", vocab=VOCAB_SIZE, positions=256, num_labels=1, pad_token_id=PAD)
        else:
            model = causal_lm("gpt2")
        # the frozen reference policy: other weights than the policy (as after some training),
        # so the log-ratios and KTO's KL estimate are not all 0
        extra = {"ref_model": causal_lm("gpt2", seed=1)} if reference else {}
        return getattr(mod, trainer_cls)(model=model, args=cfg, processing_class=tokenizer(),
                                         train_dataset=datasets.Dataset.from_list(rows()), **extra)
    return build


def kto_rows() -> list[dict[str, Any]]:
    return [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
            for i, r in enumerate(preference_rows())]


def reward_rows() -> list[dict[str, str]]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in preference_rows()]


def distillation_trainer(form: str) -> type:
    """A hand-written distillation ``Trainer``: the student's cross-entropy on the labels
    plus a KL term towards a teacher's next-token distribution (temperature 2, weight 0.5).

    ``blog``: the common form, each microbatch's own means (the model's mean loss and a
    KL ``batchmean``); ``sums``: token sums of both terms over the shifted targets, divided
    by ``num_items_in_batch``; ``twice``: the sums form divided by A once more."""
    from transformers import Trainer

    class DistillationTrainer(Trainer):
        def __init__(self, *args: Any, teacher: nn.Module, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.teacher = teacher.eval()

        def compute_loss(self, model: nn.Module, inputs: dict[str, Tensor], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            with torch.no_grad():
                teacher = self.teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            if form == "blog":
                outputs = model(**inputs)
                kl = F.kl_div(F.log_softmax(outputs.logits / 2.0, -1), F.softmax(teacher / 2.0, -1),
                              reduction="batchmean") * 4.0
                loss = 0.5 * outputs.loss + 0.5 * kl
            else:
                outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
                targets = inputs["labels"][:, 1:]
                scored = targets != -100
                logits = outputs.logits[:, :-1]
                ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
                kl = F.kl_div(F.log_softmax(logits / 2.0, -1), F.softmax(teacher[:, :-1] / 2.0, -1),
                              reduction="none").sum(-1)
                loss = (0.5 * ce + 0.5 * 4.0 * kl[scored].sum()) / num_items_in_batch
                if form == "twice":
                    loss = loss / self.args.gradient_accumulation_steps
            return (loss, outputs) if return_outputs else loss

    DistillationTrainer.__name__ = DistillationTrainer.__qualname__ = f"DistillationTrainer_{form}"
    return DistillationTrainer


def _distillation(form: str) -> Callable[..., Any]:
    def build(**args: Any) -> Any:
        from transformers import DataCollatorForLanguageModeling

        student = causal_lm("gpt2")
        student.loss_type = "ForCausalLM"  # the Trainer counts the targets after the shift
        return distillation_trainer(form)(
            model=student, teacher=causal_lm("gpt2", seed=1), args=training_args(**args),
            train_dataset=lm_examples(), data_collator=DataCollatorForLanguageModeling(tokenizer(), mlm=False))
    return build


def invariance_jobs() -> dict[str, Callable[..., Any]]:
    """Jobs whose loss the audit does not know: name -> build(**args) -> Trainer."""
    dpo = dict(beta=0.1, max_length=None, reference=True)
    return {
        "dpo_sigmoid": _trl("DPOTrainer", "DPOConfig", preference_rows, **dpo),
        "dpo_hinge": _trl("DPOTrainer", "DPOConfig", preference_rows, loss_type=["hinge"], **dpo),
        "dpo_ipo": _trl("DPOTrainer", "DPOConfig", preference_rows, loss_type=["ipo"], **dpo),
        "dpo_sigmoid_sft": _trl("DPOTrainer", "DPOConfig", preference_rows, loss_type=["sigmoid", "sft"], **dpo),
        "kto": _trl("KTOTrainer", "KTOConfig", kto_rows, beta=1.0, max_length=None, reference=True),
        "orpo": _trl("ORPOTrainer", "ORPOConfig", preference_rows, module="trl.experimental.orpo", max_length=None),
        "cpo": _trl("CPOTrainer", "CPOConfig", preference_rows, module="trl.experimental.cpo", max_length=None),
        "reward": _trl("RewardTrainer", "RewardConfig", reward_rows, reward=True, max_length=None),
        "distill_blog": _distillation("blog"),
        "distill_sums": _distillation("sums"),
        "distill_twice": _distillation("twice"),
    }
