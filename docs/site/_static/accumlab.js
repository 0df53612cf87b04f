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
