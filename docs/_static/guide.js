// A whole file copies byte for byte. sphinx-copybutton drops the last newline of what
// it copies, so that a pasted command waits for Enter; for a file that is one byte
// lost. After its copy, this puts the file's exact text on the clipboard, where the
// browser allows a page to write it (https, localhost and file pages). Elsewhere the
// copy stays sphinx-copybutton's.
document.addEventListener("click", (event) => {
  // The event's path, not its target: the copy has by now replaced the button's icon,
  // which may be what was clicked.
  const button = event
    .composedPath()
    .find((element) => element.matches?.(".code-file .copybtn"));
  const pre = button?.parentElement.querySelector("pre");
  if (pre && navigator.clipboard) {
    // Without what conf.py's copybutton_exclude leaves out: line numbers, prompts.
    const text = pre.cloneNode(true);
    text.querySelectorAll(".linenos, .gp").forEach((node) => node.remove());
    navigator.clipboard.writeText(text.textContent).catch(() => {});
  }
});
