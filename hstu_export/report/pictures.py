"""Graph pictures a person can read at any size.

A traced HSTU model has hundreds of nodes; one graphviz picture of them all is unreadable at page
width. Nodes are grouped by the module they came from (FX keeps the module stack in
``node.meta["nn_module_stack"]``; map_ops copies it onto the nodes it puts in a node's place), and a
group larger than ``GROUP_LIMIT`` nodes is split by submodule, then into consecutive chunks. Each pass
gets one overview picture (a box per group, edges between groups, one cluster per graph module) and
one picture per group, which the report shows collapsed.

Mapped nodes (``meta["mapped_from"]``), marked ones (the sparse/dense boundary) and opaque ones
(leaf modules and functions the tracer kept whole) are coloured; ``LEGEND`` says how.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx

GROUP_LIMIT = 60  # nodes of one picture: a readable graphviz layout at page width
TITLE_NAMES = 3  # module names a merged group's title lists

# (kind, fill colour, what it means): the pictures and the report's legend read the same table.
LEGEND: tuple[tuple[str, str, str], ...] = (
    ("mapped", "#b7e4c7", "put in place by map_ops (an op or foreign function mapped to the target)"),
    ("marked", "#f5b7b1", "on the sparse/dense boundary (a mark, a sparse output or a dense input from it)"),
    ("opaque", "#d7c6f5", "kept whole by the tracer (a leaf module other than torch.nn's layers, or an opaque call)"),
    ("input", "#cfe2ff", "graph input"),
    ("output", "#e2e3e5", "graph output"),
    ("attribute", "#fff3cd", "parameter or buffer"),
    ("op", "#ffffff", "any other operation"),
)
COLORS = {kind: colour for kind, colour, _ in LEGEND}


@dataclass
class NodeGroup:
    """Nodes of one graph module that one picture shows."""

    graph: str  # graph module path: "" (the top graph), "sparse", "dense"
    module: str  # the module the nodes came from ("" for the graph's own code), or joined names
    nodes: list[torch.fx.Node] = field(default_factory=list)
    part: int = 0  # 1.. when a module's nodes are split into chunks

    @property
    def title(self) -> str:
        where = self.module or "(graph inputs, outputs and top-level code)"
        names = where.split(" + ")
        if len(names) > TITLE_NAMES:
            where = " + ".join(names[:TITLE_NAMES]) + f" + {len(names) - TITLE_NAMES} more"
        graph = self.graph or "top graph"
        return f"{graph}: {where}" + (f" [part {self.part}]" if self.part else "")


def module_chain(node: torch.fx.Node) -> tuple[str, ...]:
    """The module paths ``node`` was called under, outermost first (empty when none is recorded)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ()
    paths = []
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else str(key)
        paths.append(path)
    return tuple(paths)


def group_nodes(gm: torch.fx.GraphModule, limit: int = GROUP_LIMIT) -> list[NodeGroup]:
    """Every node of ``gm`` and its nested graph modules in groups of at most ``limit`` nodes."""
    groups: list[NodeGroup] = []
    for path, sub in _graph_modules(gm):
        nodes = list(sub.graph.nodes)
        modules: dict[torch.fx.Node, tuple[str, ...]] = {}
        chains: dict[torch.fx.Node, tuple[str, ...]] = {}
        for node in nodes:
            chain = module_chain(node)
            if not chain and node.op not in ("placeholder", "output", "get_attr"):
                # Nodes a pass added without a stack belong with what they compute on (graph order is
                # topological: inputs come first).
                chain = next((modules[i] for i in node.all_input_nodes if modules.get(i)), ())
            modules[node] = chain
            mapped = node.meta.get("mapped_from")
            # What one mapped op became is a level of its own below its module: a big module splits
            # into the mapped ops' expansions before it splits into chunks.
            chains[node] = (*chain, f"{chain[-1] if chain else ''} ▸ {mapped}".strip()) if mapped else chain
        groups.extend(_split(path, (), nodes, chains, limit))
    return groups


def _split(graph: str, prefix: tuple[str, ...], nodes: list[torch.fx.Node],
           chains: dict[torch.fx.Node, tuple[str, ...]], limit: int) -> list[NodeGroup]:
    name = prefix[-1] if prefix else ""
    if len(nodes) <= limit:
        return [NodeGroup(graph, name, nodes)]
    direct = [n for n in nodes if len(chains[n]) <= len(prefix)]
    children: dict[str, list[torch.fx.Node]] = {}
    for node in nodes:
        if len(chains[node]) > len(prefix):
            children.setdefault(chains[node][len(prefix)], []).append(node)
    if not children:  # one module's own code: consecutive chunks
        return [NodeGroup(graph, name, nodes[i:i + limit], part=i // limit + 1) for i in range(0, len(nodes), limit)]
    parts: list[NodeGroup] = []
    if direct:
        parts.extend(_split(graph, prefix, direct, {n: prefix for n in direct}, limit))
    for child, members in children.items():
        parts.extend(_split(graph, (*prefix, child), members, chains, limit))
    return _merge_small(parts, limit)


def _merge_small(groups: list[NodeGroup], limit: int) -> list[NodeGroup]:
    """Consecutive small sibling groups share one picture while they fit (many tiny pictures read no
    better than one huge one)."""
    merged: list[NodeGroup] = []
    for group in groups:
        last = merged[-1] if merged else None
        if last is not None and not last.part and not group.part and len(last.nodes) + len(group.nodes) <= limit:
            names = [n or "(graph code)" for n in (last.module, group.module)]
            merged[-1] = NodeGroup(group.graph, " + ".join(dict.fromkeys(names)), last.nodes + group.nodes)
        else:
            merged.append(group)
    return merged


def _graph_modules(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    return [(p, m) for p, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)]


# ---- what a node is ------------------------------------------------------------------------------


def boundary_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Marks, the sparse graph's outputs and the dense graph's inputs that come from it."""
    found: set[torch.fx.Node] = set()
    sparse = getattr(gm, "sparse", None)
    dense = getattr(gm, "dense", None)
    crossing: set[str] = set()
    if isinstance(sparse, torch.fx.GraphModule):
        for node in sparse.graph.nodes:
            if node.op == "output" and isinstance(node.args[0], dict):
                crossing.update(node.args[0])
                found.add(node)
    if isinstance(dense, torch.fx.GraphModule):
        found.update(n for n in dense.graph.nodes if n.op == "placeholder" and n.name in crossing)
    for _, sub in _graph_modules(gm):
        found.update(n for n in sub.graph.nodes if "sparse_boundary" in str(n.target))
    return found


def node_kind(node: torch.fx.Node, owner: torch.fx.GraphModule, boundary: set[torch.fx.Node]) -> str:
    if node in boundary:
        return "marked"
    if "mapped_from" in node.meta:
        return "mapped"
    if node.op == "call_module":
        try:
            held = owner.get_submodule(str(node.target))
        except AttributeError:
            held = None
        # torch.nn's own layers are leaves of every FX trace: plain ops to a reader, not something kept.
        if not isinstance(held, torch.fx.GraphModule) and not type(held).__module__.startswith("torch.nn."):
            return "opaque"
    if node.op == "call_function" and hasattr(node.target, "__hstu_export_opaque__"):
        return "opaque"
    return {"placeholder": "input", "output": "output", "get_attr": "attribute"}.get(node.op, "op")


def node_kinds(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    boundary = boundary_nodes(gm)
    return {n: node_kind(n, sub, boundary) for _, sub in _graph_modules(gm) for n in sub.graph.nodes}


def kind_counts(group: NodeGroup, kinds: dict[torch.fx.Node, str]) -> Counter[str]:
    return Counter(kinds[n] for n in group.nodes)


# ---- graphviz sources ----------------------------------------------------------------------------

_HEADER = ['  rankdir=TB; node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']


def group_dot(group: NodeGroup, kinds: dict[torch.fx.Node, str], groups_of: dict[torch.fx.Node, int],
              groups: list[NodeGroup]) -> str:
    """One group's nodes; inputs from other groups appear as dashed stubs naming where they come from."""
    lines = ["digraph G {", *_HEADER, f'  label="{_dot_escape(group.title)}"; labelloc=t;']
    members = set(group.nodes)
    stubs: dict[torch.fx.Node, str] = {}
    for node in group.nodes:
        lines.append(f'  "{node.name}" [label="{_dot_escape(node_label(node))}", fillcolor="{COLORS[kinds[node]]}"];')
        for src in node.all_input_nodes:
            if src not in members and src not in stubs:
                origin = groups[groups_of[src]].title if src in groups_of else "?"
                stubs[src] = f"ext_{src.name}"
                lines.append(f'  "{stubs[src]}" [label="{_dot_escape(src.name + chr(10) + "from " + origin)}", '
                             'style="dashed", shape=note, fontsize=8];')
    for node in group.nodes:
        for src in node.all_input_nodes:
            lines.append(f'  "{stubs.get(src, src.name)}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def overview_dot(groups: list[NodeGroup], kinds: dict[torch.fx.Node, str], links: list[str] | None = None) -> str:
    """A box per group (its node count and coloured kinds), edges between groups; a cluster per graph
    module. ``links``: each group's picture file, which its box links to (the SVG opened on its own)."""
    groups_of = {n: i for i, g in enumerate(groups) for n in g.nodes}
    lines = ["digraph G {", *_HEADER]
    by_graph: dict[str, list[int]] = {}
    for index, group in enumerate(groups):
        by_graph.setdefault(group.graph, []).append(index)
    for cluster, (graph, indices) in enumerate(by_graph.items()):
        lines.append(f"  subgraph cluster_{cluster} {{")
        lines.append(f'    label="{_dot_escape(graph or "top graph")}"; style=dashed;')
        for index in indices:
            group = groups[index]
            counts = kind_counts(group, kinds)
            special = [f"{counts[k]} {k}" for k in ("mapped", "marked", "opaque") if counts[k]]
            label = f"{group.module or '(graph code)'}" + (f" [{group.part}]" if group.part else "")
            label += f"\n{len(group.nodes)} nodes" + (f": {', '.join(special)}" if special else "")
            colour = next((COLORS[k] for k in ("marked", "opaque", "mapped") if counts[k]), COLORS["op"])
            link = f', URL="{_dot_escape(links[index])}"' if links else ""
            lines.append(f'    "grp{index}" [label="{_dot_escape(label)}", fillcolor="{colour}"{link}];')
        lines.append("  }")
    edges: Counter[tuple[int, int]] = Counter()
    for index, group in enumerate(groups):
        for node in group.nodes:
            for src in node.all_input_nodes:
                origin = groups_of.get(src)
                if origin is not None and origin != index:
                    edges[(origin, index)] += 1
    for (a, b), count in edges.items():
        lines.append(f'  "grp{a}" -> "grp{b}" [label="{count}", fontsize=8];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def node_label(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        what = node.op
    elif node.op == "call_function":
        what = getattr(node.target, "__name__", str(node.target))
        what = str(node.target) if "OpOverload" in type(node.target).__name__ else what
    else:
        what = f"{node.op} {node.target}"
    label = f"{node.name}\n{what}"
    if "mapped_from" in node.meta:
        label += f"\n(from {node.meta['mapped_from']})"
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        label += f"\n{list(meta.shape)} {str(meta.dtype).removeprefix('torch.')}"
    return label


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def largest(groups: Iterable[NodeGroup]) -> int:
    return max((len(g.nodes) for g in groups), default=0)
