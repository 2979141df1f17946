// A small, safe markdown renderer for model output: it builds DOM nodes (never innerHTML), so text is never
// markup. Fenced code blocks and inline code keep their text exactly; emphasis is `*` / `**` only, so that
// identifiers such as __init__ and snake_case stay as written. An unclosed fence (a stream still arriving)
// renders as a code block up to the end of the text.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const BULLET = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const INLINE = /(\*\*([^*]+?)\*\*|\*([^*\s][^*]*?)\*|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\))/;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function codeBlock(code, language) {
  const block = el("div", "code-block");
  const head = el("div", "code-head");
  head.append(el("span", "lang", language || "code"));
  const copy = el("button", "copy", "copy");
  copy.type = "button";
  copy.addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText(code));
  head.append(copy);
  const pre = el("pre");
  const codeNode = el("code", language ? `language-${language}` : null, code);
  pre.append(codeNode);
  block.append(head, pre);
  return block;
}

// Inline markdown of one paragraph: code spans first (their text is final), then links, bold and italic.
export function renderInline(text, parent) {
  let rest = text;
  while (rest) {
    const tick = rest.match(/(`+)([\s\S]*?[^`])\1(?!`)/);
    if (!tick) break;
    appendEmphasis(rest.slice(0, tick.index), parent);
    const inner = tick[2];
    const trimmed = /^ .* $/.test(inner) && inner.trim() ? inner.slice(1, -1) : inner;
    parent.append(el("code", null, trimmed));
    rest = rest.slice(tick.index + tick[0].length);
  }
  appendEmphasis(rest, parent);
  return parent;
}

function appendEmphasis(text, parent) {
  let rest = text;
  while (rest) {
    const m = rest.match(INLINE);
    if (!m) break;
    appendText(rest.slice(0, m.index), parent);
    if (m[2] !== undefined) parent.append(appendEmphasisTo(el("strong"), m[2]));
    else if (m[3] !== undefined) parent.append(appendEmphasisTo(el("em"), m[3]));
    else {
      const link = el("a", null, m[4]);
      link.href = m[5];
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      parent.append(link);
    }
    rest = rest.slice(m.index + m[0].length);
  }
  appendText(rest, parent);
}

function appendEmphasisTo(node, text) {
  appendEmphasis(text, node);
  return node;
}

function appendText(text, parent) {
  const lines = text.split("\n");
  lines.forEach((line, i) => {
    if (i) parent.append(el("br"));
    if (line) parent.append(document.createTextNode(line));
  });
}

// Renders `text` into `container` (emptied first).
export function renderMarkdown(text, container) {
  container.replaceChildren(...blocks(text.replace(/\r\n?/g, "\n").split("\n")));
  return container;
}

function blocks(lines) {
  const out = [];
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) out.push(renderInline(paragraph.join("\n"), el("p")));
    paragraph = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      flush();
      const closing = new RegExp(`^ {0,3}${fence[1][0] === "`" ? "`" : "~"}{${fence[1].length},}\\s*$`);
      const code = [];
      for (i++; i < lines.length && !closing.test(lines[i]); i++) code.push(lines[i]);
      out.push(codeBlock(code.join("\n"), fence[2]));
      continue;
    }
    if (!line.trim()) {
      flush();
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      flush();
      out.push(renderInline(heading[2], el(`h${Math.min(heading[1].length + 2, 6)}`)));
      continue;
    }
    if (RULE.test(line)) {
      flush();
      out.push(el("hr"));
      continue;
    }
    if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].match(QUOTE)[1]);
      i--;
      const quote = el("blockquote");
      quote.append(...blocks(quoted));
      out.push(quote);
      continue;
    }
    if (BULLET.test(line) && !paragraph.length) {
      const end = listEnd(lines, i);
      out.push(list(lines.slice(i, end)));
      i = end - 1;
      continue;
    }
    paragraph.push(line);
  }
  flush();
  return out;
}

// The index after the list that starts at `start`: items and their indented continuation lines.
function listEnd(lines, start) {
  let i = start + 1;
  while (i < lines.length) {
    const line = lines[i];
    if (BULLET.test(line) || (/^\s{2,}\S/.test(line) && !FENCE.test(line))) i++;
    else break;
  }
  return i;
}

function list(lines) {
  const first = lines[0].match(BULLET);
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  const indent = first[1].length;
  let item = null;
  let text = [];
  const close = () => {
    if (item) node.append(renderInline(text.join("\n"), item));
  };
  for (let j = 0; j < lines.length; j++) {
    const m = lines[j].match(BULLET);
    if (m && m[1].length <= indent + 1) {
      close();
      item = el("li");
      text = [m[3]];
    } else if (m) {
      const end = nestedEnd(lines, j, m[1].length);
      close();
      node.lastChild.append(list(lines.slice(j, end)));
      item = null;
      text = [];
      j = end - 1;
    } else {
      text.push(lines[j].trim());
    }
  }
  close();
  return node;
}

function nestedEnd(lines, start, indent) {
  let j = start + 1;
  while (j < lines.length) {
    const m = lines[j].match(BULLET);
    if (m && m[1].length < indent) break;
    j++;
  }
  return j;
}
