"""mkdocs hooks: the configuration reference, generated from `IPUConfig`'s own schema.

The marker `<!-- ipu-config-reference -->` in `configuration.md` becomes one
table per category: each attribute's name, type, default, what it means, and
what it does on the device model. Nothing is written twice.
"""

from __future__ import annotations

MARKER = "<!-- ipu-config-reference -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference())


def reference() -> str:
    """The reference as Markdown tables, one per category."""
    from keras_ipu.config import attributes, schema

    sections: dict[str, list[str]] = {}
    for path, node in attributes.walk(schema.IPU_CONFIG_SCHEMA):
        if isinstance(node, attributes.Category):
            continue
        category = path.rsplit(".", 1)[0] if "." in path else "(top level)"
        sections.setdefault(category, []).append(
            f"| `{path}` | `{attributes.type_name(node.type)}` | `{node.default!r}` | "
            f"{_cell(node.doc)} | {_cell(node.effect)} |")
    lines = []
    for category, rows in sections.items():
        lines += [f"## `{category}`", "", "| attribute | type | default | meaning | keras_ipu |",
                  "|---|---|---|---|---|", *rows, ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(str(text or "").split()).replace("|", "\\|")
