// The themes (pydata-sphinx-theme 0.20 under sphinx-book-theme 1.4) attach the sidebar
// toggles' click handlers to the FIRST .primary-toggle / .secondary-toggle on the page,
// a navbar button that this layout never shows; the visible buttons in the article header
// did nothing (on a phone the lessons' menu could not be opened). Forward their clicks.
document.addEventListener("DOMContentLoaded", () => {
  for (const kind of [".primary-toggle", ".secondary-toggle"]) {
    const [first, ...others] = document.querySelectorAll(kind);
    for (const button of others) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopImmediatePropagation();
        first.click();
      });
    }
  }
});

// Search snippets: Sphinx takes a result's text from [role="main"], which in this theme also
// holds the article's header buttons ("Light Dark ..."); take it from the article itself.
function accumlabSearchText() {
  if (typeof Search === "undefined" || Search.accumlabPatched) return;
  Search.htmlToText = (htmlString, anchor) => {
    const doc = new DOMParser().parseFromString(htmlString, "text/html");
    for (const query of [".headerlink", "script", "style", ".run-this-notebook", ".al-exercise"]) {
      doc.querySelectorAll(query).forEach((el) => el.remove());
    }
    const article = doc.querySelector("article.bd-article") || doc.querySelector('[role="main"]');
    if (!article) return "";
    if (anchor) {
      const target = article.querySelector(anchor);
      if (target) {
        const section = target.closest("section") || target.nextElementSibling || target;
        return section.textContent;
      }
    }
    return article.textContent;
  };
  Search.accumlabPatched = true;
}
accumlabSearchText();
document.addEventListener("DOMContentLoaded", accumlabSearchText);

// Search results land on a section: a result that names only its page is pointed at the
// section of that page where the query first appears (the deepest section around it).
function accumlabSectionLinks() {
  const results = document.getElementById("search-results");
  const query = new URLSearchParams(window.location.search).get("q") || "";
  const words = query.toLowerCase().split(/\s+/).filter((w) => w.length > 1);
  if (!results || !words.length) return;
  // whole words only ("oom" is not in "room"); Sphinx's stemmer may also match "syncs" for "sync"
  const escape = (w) => w.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  const pattern = new RegExp(`(^|[^\\w])(${words.map(escape).join("|")})\\w{0,3}($|[^\\w])`, "i");
  const pages = new Map();
  const point = async (link) => {
    const href = link.getAttribute("href");
    if (!href || href.includes("#") || link.dataset.accumlabSection) return;
    link.dataset.accumlabSection = "pending";
    const url = new URL(href, window.location.href);
    if (!pages.has(url.pathname)) pages.set(url.pathname, fetch(url).then((r) => r.text()));
    const doc = new DOMParser().parseFromString(await pages.get(url.pathname), "text/html");
    const article = doc.querySelector("article.bd-article");
    if (!article) return;
    // not the title, nor the lesson's summary and run box above its text
    article.querySelectorAll("h1, .al-teaches, .run-this-notebook, .headerlink, script, style")
      .forEach((e) => e.remove());
    const walker = doc.createTreeWalker(article, NodeFilter.SHOW_TEXT);
    while (walker.nextNode()) {
      if (!pattern.test(walker.currentNode.textContent)) continue;
      const section = walker.currentNode.parentElement.closest("section[id]");
      // the page's own top section is where the link already goes
      if (section && section.parentElement.closest("section[id]")) {
        link.setAttribute("href", `${href}#${section.id}`);
      }
      break;
    }
    link.dataset.accumlabSection = "done";
  };
  new MutationObserver(() => results.querySelectorAll("ul.search li > a").forEach(point))
    .observe(results, { childList: true, subtree: true });
}
document.addEventListener("DOMContentLoaded", accumlabSectionLinks);
