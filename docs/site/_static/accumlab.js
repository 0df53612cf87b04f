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
