"""Guards on the package's structure, read from its source with ``ast`` (cheap: no import of the
package, no model): no import circle (imports inside functions and under ``TYPE_CHECKING``
included), every format number defined once in ``indexcache.formats``, no unrestricted unpickling.
docs/architecture.md draws the structure these guard."""

import ast
import re
from pathlib import Path


PKG = Path(__file__).resolve().parents[1] / "python" / "indexcache"
FORMATS = PKG / "formats.py"


def _modules() -> dict:
    """Dotted module name -> (path, is package)."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _trees() -> dict:
    return {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in _modules().items()}


def import_graph() -> dict:
    """Module -> the package modules it imports anywhere in its source (``from a import b`` names
    module ``a.b`` when that is a module, else ``a``); the compiled extension is not a module here."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.add(full if full in mods or full.endswith("._C") else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def find_cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = import_graph()
    assert "indexcache.loader" in graph and "indexcache.models.deepseek_v32" in graph
    assert find_cycles(graph) == []


# The numbers of the data formats (DESIGN.md §4, §5): literal only in indexcache/formats.py.
FORMAT_LITERALS = {448, 656, 132, 576, 528}


def _format_names() -> set:
    names = set()
    for node in ast.parse(FORMATS.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            for n in ast.walk(t) if t is not None else ():
                if isinstance(n, ast.Name):
                    names.add(n.id)
    return names


def test_each_format_constant_is_defined_once():
    names = _format_names()
    assert {"FP8_MAX", "FP8_DS_MLA_BYTES", "INDEX_K_BYTES", "QUANT_GROUP", "MLA_LATENT", "MLA_ROPE",
            "INDEX_K_EPS", "INDEX_Q_EPS", "LATENT_NORM_EPS", "BLOCK_SIZE"} <= names
    problems = []
    for name, tree in _trees().items():
        if name == "indexcache.formats":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(n, ast.Name) and n.id in names:
                            problems.append(f"{name}:{node.lineno} assigns {n.id}")
            if isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value in FORMAT_LITERALS:
                problems.append(f"{name}:{node.lineno} writes the literal {node.value}")
    assert problems == []


def test_no_unrestricted_unpickling():
    """Nothing loads with ``torch.load(..., weights_only=False)`` (package, tests, benchmarks, scripts)."""
    root = PKG.parents[1]
    problems = []
    for f in sorted(p for d in ("python", "tests", "bench", "scripts") for p in (root / d).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "weights_only" and \
                    not (isinstance(node.value, ast.Constant) and node.value.value is True):
                problems.append(f"{f.relative_to(root)}:{node.value.lineno}")
    assert problems == []


def test_no_module_only_re_exports():
    """No module of the package is a forwarding shim (issue 32): none copies another module's
    namespace into its own (``globals().update(vars(...))``) and none warns that it is deprecated."""
    problems = []
    for f in sorted(PKG.rglob("*.py")):
        text = f.read_text()
        if re.search(r"globals\(\)\.update\(.*\bvars\(", text) or "DeprecationWarning" in text:
            problems.append(str(f.relative_to(PKG)))
    assert problems == []


def test_the_model_keeps_no_generate_method():
    from indexcache.models import DeepseekV32ForCausalLM

    assert not hasattr(DeepseekV32ForCausalLM, "generate")  # callers use indexcache.runtime.generate


def _functions():
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


def test_no_public_function_takes_more_than_ten_parameters():
    """Settings travel as objects (``runtime.GenerationSettings``), not as long parameter lists."""
    problems = []
    for name, fn in _functions():
        a = fn.args
        params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs] + [p.arg for p in (a.vararg, a.kwarg) if p]
        params = [p for p in params if p not in ("self", "cls")]
        if not fn.name.startswith("_") and len(params) > 10:
            problems.append(f"{name}.{fn.name}: {len(params)} parameters")
    assert problems == []
    gen = next(fn for name, fn in _functions() if name == "indexcache.runtime.generation" and fn.name == "generate")
    assert len(gen.args.args) + len(gen.args.kwonlyargs) <= 5


def test_generation_steps_are_short():
    """Prefill, one decode step and one speculative round are separate functions of <= 60 lines."""
    steps = {fn.name: fn.end_lineno - fn.lineno + 1 for name, fn in _functions()
             if name == "indexcache.runtime.generation"}
    for step in ("generate", "prefill", "decode_step", "mtp_round", "draft_step0", "draft_reuse", "verify", "decode"):
        assert steps[step] <= 60, (step, steps[step])


# Sizes that keep each module and function readable (issue 18: the model core).
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_PUBLIC_PARAMS = 500, 80, 10


def _size_problems() -> list:
    problems = []
    for name, (path, _) in _modules().items():
        src = path.read_text()
        if len(src.splitlines()) > MAX_FILE_LINES:
            problems.append(f"{name}: {len(src.splitlines())} lines")
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                problems.append(f"{name}.{node.name}: {lines} lines")
            a = node.args
            params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            if not node.name.startswith("_") and len(params) > MAX_PUBLIC_PARAMS:
                problems.append(f"{name}.{node.name}: {len(params)} parameters")
    return problems


def test_no_long_file_function_or_parameter_list():
    assert _size_problems() == []


def test_the_size_guard_finds_oversized_code(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    params = ", ".join(f"p{i}" for i in range(MAX_PUBLIC_PARAMS + 1))
    pkg = tmp_path / "python" / "indexcache"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "big.py").write_text(f"def long():\n{body}\n\n\ndef wide({params}):\n    pass\n")
    monkeypatch.setattr(__import__(__name__), "PKG", pkg)
    found = _size_problems()
    assert any("big.long" in p for p in found) and any("big.wide: 11 parameters" in p for p in found)


def test_blocks_do_not_import_the_tools_or_the_runtime():
    """Imports run one way: cli -> tools -> runtime -> models -> parallel/ops/plan/config."""
    graph = import_graph()
    mods = _modules()
    shims = {m for m, (path, _) in mods.items() if path.read_text().startswith('"""Deprecated location')}
    lower = [m for m in graph if m.startswith(("indexcache.models", "indexcache.parallel")) and m not in shims]
    for m in lower:
        bad = {t for t in graph[m] if t.startswith(("indexcache.tools", "indexcache.cli", "indexcache.runtime",
                                                    "indexcache.integrations"))}
        assert not bad, f"{m} imports {sorted(bad)}"
    for m in (m for m in graph if m.startswith("indexcache.tools")):
        assert not {t for t in graph[m] if t.startswith("indexcache.cli")}, m
