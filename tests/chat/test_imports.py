"""The layout's one direction, checked on the source: chat → engine → models, never back; inside
models, formats → quant → kernels → the planner's serving rules (models/plan/serving.py) → ops →
architectures → the planner and the loader, never back (an architecture reaches a kernel only
through models/ops, the engine only through the models package's and the ops' names;
docs/ARCHITECTURE.md); no import cycle among our modules; and the kernels' availability checks
asked only by those serving rules. Every import
counts, those inside functions too (a cycle through a function-level import is still a cycle)."""
import ast
import os

from tests.support.paths import ROOT

PACKAGES = ("chat", "engine", "models")
# (importer prefix, imported prefix): edges that must not exist
FORBIDDEN = [("engine", "chat"), ("models", "chat"), ("models", "engine"),
             ("models.kernels", "models.architectures"), ("models.kernels", "models.formats"),
             ("models.kernels", "models.plan"), ("models.kernels", "models.loader"),
             ("models.formats", "models.kernels"), ("models.formats", "models.plan"),
             ("models.formats", "models.quant"), ("models.formats", "models.architectures"),
             ("models.formats", "models.loader"), ("models.formats", "models.sharding"),
             ("models.quant", "models.kernels"), ("models.quant", "models.architectures"),
             ("models.quant", "models.plan"), ("models.quant", "models.loader"),
             ("models.architectures", "models.plan"), ("models.architectures", "models.loader"),
             ("models.architectures", "models.kernels"), ("models.plan", "models.kernels"), ("models.kernels", "models.ops"),
             ("models.ops", "models.architectures"), ("models.ops", "models.plan"), ("models.ops", "models.loader"),
             ("models.formats", "models.ops"), ("models.quant", "models.ops"), ("engine", "models.kernels"),
             ("models.plan.serving", "models.plan"), ("models.plan.serving", "models.ops"),
             ("models.plan.serving", "models.architectures"), ("models.plan.serving", "models.loader")]
# The planner's serving rules are a room of their own under the ops: they alone of models/plan ask
# the kernels, and the ops ask them
ALLOWED = [("models.plan.serving", "models.kernels"), ("models.ops", "models.plan.serving")]


def modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return out


def imports(name: str, path: str, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports (`from a import b` counts a.b where that is a module)."""
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a.b.c where only a.b is ours: count a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(m, p, known) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def back_edges(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted({(a, b) for a, targets in g.items() for b in targets
                   for src, dst in FORBIDDEN if _under(a, src) and _under(b, dst)
                   and not any(_under(a, x) and _under(b, y) for x, y in ALLOWED)})


def test_no_back_edges():
    assert back_edges(graph()) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_checks_can_fail():
    """The same checks on graphs with a planted cycle and a planted back-edge."""
    g = graph()
    assert "models.ops.cpu" in g["models.architectures.causal_lm"] and "models.kernels" in g["models.ops.cpu"]
    planted = {k: set(v) for k, v in g.items()}
    planted["models.kernels.cpu.step"].add("models.architectures.causal_lm")  # a kernel importing its caller
    planted["models.architectures.causal_lm"].add("models.kernels.cpu.step")  # an architecture past the ops
    assert ("models.kernels.cpu.step", "models.architectures.causal_lm") in back_edges(planted)
    assert ("models.architectures.causal_lm", "models.kernels.cpu.step") in back_edges(planted)
    assert any("models.kernels.cpu.step" in c and "models.architectures.causal_lm" in c for c in cycles(planted))
    planted["engine.session"].add("chat.repl")
    assert ("engine.session", "chat.repl") in back_edges(planted)
    planted["models.ops.linear"].add("models.plan.planner")  # the ops past the serving rules
    planted["models.plan.serving"].add("models.ops.linear")
    assert {("models.ops.linear", "models.plan.planner"), ("models.plan.serving", "models.ops.linear")} \
        <= set(back_edges(planted))
    assert ("models.ops.linear", "models.plan.serving") not in back_edges(planted)


# The kernels' availability checks: whether a kernel is on, serves a device and dtype, or takes a
# call's sizes. Only models/plan/serving.py (the planner's rules, which the ops ask at call time)
# names them outside models/kernels, so that what a plan says runs is what the forwards run.
AVAILABILITY = frozenset(("ENABLED", "serves", "usable", "prefill_usable", "fits", "attention_fits",
                          "attention_usable", "rope_usable", "can_precompile", "decode_fits", "scan_fits",
                          "solve_fits", "reads_int8", "takes", "cpu_step_serves", "cpu_blocks_served",
                          "rows16_types", "rows16_forms", "avx512_forms", "int8_inputs"))
AVAILABILITY_ASKERS = ("models.kernels", "models.plan.serving")


def availability_asks(sources: dict[str, str]) -> list[str]:
    """`module:line name` of each use of a kernel module's availability check (an attribute of a
    name bound to a models.kernels module, a name imported from one, or a `calls(module, "name")`
    op) outside AVAILABILITY_ASKERS."""
    out = []
    for name, path in sorted(sources.items()):
        if any(_under(name, r) for r in AVAILABILITY_ASKERS):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        kernel_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and "kernels" in (node.module or "").split("."):
                for a in node.names:
                    if a.name in AVAILABILITY:
                        out.append((name, node.lineno, a.name))
                    kernel_names.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                kernel_names.update(a.asname or a.name for a in node.names if ".kernels" in a.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in AVAILABILITY and isinstance(node.value, ast.Name) \
                    and node.value.id in kernel_names:
                out.append((name, node.lineno, node.attr))
            elif isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id in kernel_names and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in AVAILABILITY:
                out.append((name, node.lineno, node.args[1].value))
    return [f"{name}:{line} {what}" for name, line, what in sorted(out)]


def test_only_the_planner_asks_whether_a_kernel_serves():
    assert availability_asks(modules()) == []


def test_the_availability_check_can_fail(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from ..kernels.cuda import base as _base, conv\nfrom ..kernels.cuda.ssd import decode_fits\n"
                       "def f(x):\n    return _base.usable(x) and conv.ENABLED\n"
                       "g = calls(_base, 'fits')\nh = calls(_base, 'silu_mul')\n")
    assert availability_asks({"models.ops.planted": str(planted)}) == [
        "models.ops.planted:2 decode_fits", "models.ops.planted:4 ENABLED", "models.ops.planted:4 usable",
        "models.ops.planted:5 fits"]
    assert availability_asks({"models.plan.serving": str(planted)}) == []


# Where the environment may be read: engine/config.py (the engine's and the models' variables) and
# the front end's own folders and switches (chat/: XDG state and config folders, CHAT_* settings,
# NO_COLOR)
ENVIRONMENT_READERS = ("engine.config", "chat")


def environment_reads(sources: dict[str, str]) -> list[str]:
    """`module:line` of each os.environ / os.getenv / os.putenv use outside ENVIRONMENT_READERS."""
    out = []
    for name, path in sorted(sources.items()):
        if any(_under(name, r) for r in ENVIRONMENT_READERS):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "environb")
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                out.append((name, node.lineno))
    return [f"{name}:{line}" for name, line in sorted(out)]


def test_the_environment_is_read_in_one_place():
    assert environment_reads(modules()) == []


def test_the_environment_check_can_fail(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import os\nFLAG = os.environ.get('CHAT_SOMETHING')\nOTHER = os.getenv('X')\n")
    assert environment_reads({"models.kernels.planted": str(planted)}) == ["models.kernels.planted:2",
                                                                           "models.kernels.planted:3"]
    assert environment_reads({"chat.planted": str(planted)}) == []


def test_tests_import_helpers_from_support_only(files: list[str] | None = None) -> None:
    """The tests' own layout: a test module imports helpers from tests/support only, never from
    another test module (whose tests would then run twice, or not at all, by collection order)."""
    if files is None:
        files = [os.path.join(folder, f) for folder, _, names in os.walk(os.path.join(ROOT, "tests"))
                 for f in names if f.startswith("test_") and f.endswith(".py")]
    bad = []
    for path in sorted(files):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m.rpartition(".")[2].startswith("test_") for m in mods):
                bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not bad, f"test modules importing test modules (move the helper to tests/support): {bad}"


def test_the_test_layout_check_can_fail(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text("from tests.kernels.test_block_int8 import inputs\n")
    try:
        test_tests_import_helpers_from_support_only([str(planted)])
    except AssertionError as e:
        assert "test_planted.py:1" in str(e)
    else:
        raise AssertionError("a planted import of a test module passed")


def test_importing_models_loads_no_kernel_module():
    """`import models` (every `chat` command's first step) loads none of the CUDA kernel modules
    (and so not Triton): they come with an architecture or a plan's question, at load."""
    import subprocess
    import sys
    code = "import sys, models; print(sorted(m for m in sys.modules if m.startswith('models.kernels.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
