"""Imports go one way: every import of every module in blocks/, p2p/, node/, cli/, bench/ (absolute
``blocktrain.x`` and relative, at module level or inside a function), read with ``ast``.

- blocks/ imports nothing of ours (only blocktrain.blocks) and no network library;
- p2p/ imports none of node/, cli/, bench/, blocks/;
- node/ imports neither cli/ nor bench/, and no hivemind (the network library is p2p/'s);
- bench/ does not import cli/ and no hivemind; cli/ imports no hivemind (p2p/ is its only home);
- nothing imports the tests.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("blocks", "p2p", "node", "cli", "bench")
NETWORK_LIBS = frozenset({"hivemind", "libp2p", "fastapi", "uvicorn", "httpx", "grpc", "multiaddr"})
TEST_MODULES = frozenset({"tests", "test_utils", "conftest"})

# package -> (packages of ours it must not import, outside libraries it must not import)
FORBIDDEN: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "blocks": (frozenset(PACKAGES) - {"blocks"}, NETWORK_LIBS),
    "p2p": (frozenset({"node", "cli", "bench", "blocks"}), frozenset()),
    "node": (frozenset({"cli", "bench"}), frozenset({"hivemind"})),
    "bench": (frozenset({"cli"}), frozenset({"hivemind"})),
    "cli": (frozenset(), frozenset({"hivemind"})),
}

def module_name(root: Path, path: Path) -> str:
    """``node/swarm/launcher.py`` -> ``blocktrain.node.swarm.launcher`` (a package's __init__ -> the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["blocktrain", *parts])


def imported_modules(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved.
    ``from X import y`` yields ``X`` and ``X.y`` (y may be a module)."""
    mod = module_name(root, path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 >= len(base_parts):
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top package")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names if alias.name != "*"]
    return out


def violations(root: Path) -> list[tuple[str, int, str, str]]:
    """Every import arrow the wrong way under ``root``: (file relative to root, line, module, rule)."""
    found: set[tuple[str, int, str, str]] = set()
    for pkg in PACKAGES:
        ours_forbidden, libs_forbidden = FORBIDDEN[pkg]
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for line, name in imported_modules(root, path):
                parts = name.split(".")
                if parts[0] in TEST_MODULES:
                    found.add((rel, line, name, "imports the tests"))
                elif parts[0] == "blocktrain" and len(parts) > 1 and parts[1] in ours_forbidden:
                    found.add((rel, line, name, f"{pkg} -> {parts[1]}"))
                elif parts[0] == "blocktrain" and len(parts) > 1 and parts[1] not in PACKAGES:
                    found.add((rel, line, name, f"{pkg} -> unknown package blocktrain.{parts[1]}"))
                elif parts[0] in libs_forbidden:
                    found.add((rel, line, name, f"{pkg} -> {parts[0]}"))
    # ``from X import y`` reports X and X.y: keep one line per (file, line, rule)
    seen: dict[tuple[str, int, str], tuple[str, int, str, str]] = {}
    for v in sorted(found, key=lambda v: (v[0], v[1], v[3], len(v[2]))):
        seen.setdefault((v[0], v[1], v[3]), v)
    return sorted(seen.values())


def test_imports_go_one_way():
    bad = violations(REPO)
    assert not bad, "imports the wrong way:\n" + "\n".join(f"{f}:{ln}: {m} ({rule})" for f, ln, m, rule in bad)


def test_checker_reports_each_kind_of_wrong_arrow(tmp_path):
    def tree(files: dict[str, str]) -> Path:
        root = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        for pkg in PACKAGES:
            (root / pkg).mkdir(parents=True)
            (root / pkg / "__init__.py").write_text("")
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        return root

    clean = tree({
        "blocks/a.py": "from .b import x\nfrom . import c\nimport torch\n",
        "p2p/w.py": "import hivemind\nfrom blocktrain.p2p.errors import E\n",
        "node/n.py": "from ..blocks.chain import traverse\nfrom ..p2p import discovery\nimport httpx\n",
        "node/sub/m.py": "from ...blocks import data\nfrom ..n import f\n",
        "bench/b.py": "from blocktrain.node.swarm import launcher\nfrom ..blocks import data\n",
        "cli/c.py": "from ..bench import p2p\nfrom blocktrain.node import node\n",
    })
    assert violations(clean) == []

    cases = {
        # one bad import each: (file, text) -> the rule reported
        ("blocks/a.py", "def f():\n    from ..p2p import tensors\n"): "blocks -> p2p",
        ("blocks/objectives/o.py", "from ...node.trainer import T\n"): "blocks -> node",
        ("blocks/a.py", "import fastapi\n"): "blocks -> fastapi",
        ("blocks/a.py", "def f():\n    import hivemind.dht\n"): "blocks -> hivemind",
        ("p2p/w.py", "from blocktrain.blocks.chain import HopRequest\n"): "p2p -> blocks",
        ("p2p/w.py", "from ..node import node\n"): "p2p -> node",
        ("node/sub/m.py", "from ...cli import main\n"): "node -> cli",
        ("node/n.py", "import blocktrain.bench.swarm\n"): "node -> bench",
        ("node/n.py", "class A:\n    def f(self):\n        from hivemind import DHT\n"): "node -> hivemind",
        ("bench/b.py", "from ..cli.render import emit_json\n"): "bench -> cli",
        ("bench/b.py", "def f():\n    from hivemind.proto import runtime_pb2\n"): "bench -> hivemind",
        ("cli/c.py", "import hivemind\n"): "cli -> hivemind",
        ("bench/b.py", "from test_utils.wire_node import hop_handler\n"): "imports the tests",
        ("cli/c.py", "import tests.test_utils\n"): "imports the tests",
    }
    for (rel, text), rule in cases.items():
        found = violations(tree({rel: text}))
        assert [(f, r) for f, _, _, r in found] == [(rel, rule)], (rel, text, found)
