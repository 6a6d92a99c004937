"""What the HTML forms must never contain: they stand in where widgets cannot render (VS Code without the
widget renderer, nbviewer, GitHub, nbconvert), where scripts do not run and nothing may be fetched.

The markup is parsed (escaped text, such as a user's source line quoted in a report, is only text)."""
from __future__ import annotations

import re
from html.parser import HTMLParser

# Elements that run code or load or embed something from elsewhere.
FORBIDDEN_TAGS = {"script", "iframe", "frame", "object", "embed", "link", "img", "image", "use", "audio",
                  "video", "source", "track", "picture", "base", "meta", "form", "applet", "foreignobject"}
URL_ATTRS = {"src", "href", "xlink:href", "srcset", "action", "formaction", "data", "poster", "background"}
NETWORK_IN_CSS = re.compile(r"url\s*\(|@import|expression\s*\(|https?:|//", re.IGNORECASE)


class _Finder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        if tag in FORBIDDEN_TAGS:
            self.found.append(f"<{tag}>")
        for name, value in attrs:
            value = value or ""
            if name.startswith("on"):
                self.found.append(f"<{tag} {name}=...> (an event handler)")
            elif name in URL_ATTRS:
                self.found.append(f"<{tag} {name}={value!r}>")
            elif name == "style" and NETWORK_IN_CSS.search(value):
                self.found.append(f"<{tag} style={value!r}>")
            elif "javascript:" in value.lower():
                self.found.append(f"<{tag} {name}={value!r}>")
        self._in_style = tag == "style"

    handle_startendtag = handle_starttag

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style and NETWORK_IN_CSS.search(data):
            self.found.append(f"<style>{data[:80]}")


def problems(html: str) -> list[str]:
    """Each piece of `html`'s markup that needs JavaScript or the network."""
    finder = _Finder()
    finder.feed(html)
    finder.close()
    return finder.found
