"""The architecture's layering: the core library never imports the Dagster side (and imports with Dagster
not installed at all), product code never edits sys.path, no module is on an import circle or imports a
layer above its own, the code location loads by module name from any working directory, and the
distribution installs two top-level names: shardprep and shardprep_dagster."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.configs import CHECKOUT

DAGSTER_SIDE = {"dagster", "dagster_webserver", "dagster_postgres", "dagster_celery", "celery", "shardprep_dagster",
                "assets", "resources", "sensors", "orchestration", "definitions", "tests", "demo", "bench"}
PRODUCT = ["shardprep", "assets", "resources", "sensors", "orchestration", "shardprep_dagster.definitions.py"]


def _modules(*roots: str) -> list[Path]:
    out = []
    for root in roots:
        path = CHECKOUT / root
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_core_imports_nothing_of_the_dagster_side():
    offenders = {str(p.relative_to(CHECKOUT)): sorted(_imported_roots(p) & DAGSTER_SIDE)
                 for p in _modules("shardprep")}
    assert {p: bad for p, bad in offenders.items() if bad} == {}


def test_importing_the_whole_core_loads_no_dagster():
    names = [".".join(p.relative_to(CHECKOUT).with_suffix("").parts) for p in _modules("shardprep")]
    names = [n.removesuffix(".__init__") for n in names]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(DAGSTER_SIDE)!r})\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_product_code_never_edits_sys_path():
    edits = []
    for path in _modules(*PRODUCT):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                edits.append(f"{path.relative_to(CHECKOUT)}:{node.lineno}")
    assert edits == []


def test_code_location_loads_by_module_name_from_anywhere(tmp_path):
    # as a worker on another machine loads it: the installed distribution, no checkout on sys.path
    code = ("import shardprep_dagster.definitions as definitions, sys\n"
            "keys = sorted(k.to_user_string() for k in definitions.defs.resolve_asset_graph().get_all_asset_keys())\n"
            "print(keys)\n")
    env = {**os.environ, "PYTHONPATH": "", "SHARDPREP_CONFIG": str(tmp_path / "none.yaml")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "image_shards" in out.stdout and "image_energon_index" in out.stdout
    validate = subprocess.run([str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w",
                               "workspace.yaml"], cwd=CHECKOUT, env={**env, "DAGSTER_HOME": str(tmp_path)},
                              capture_output=True, text=True, timeout=300)
    logs = validate.stdout + validate.stderr
    assert validate.returncode == 0 and "Validation successful for code location shardprep" in logs, \
        logs[-2000:]


def test_the_distribution_installs_two_top_level_names_and_its_core_needs_no_dagster():
    from importlib.metadata import distribution

    dist = distribution("shardprep")
    tops = {name.split(".")[0] for name in (dist.read_text("top_level.txt") or "").split()}
    editable = {p.stem for p in Path(sys.prefix).glob("lib/python*/site-packages/__editable___shardprep*finder.py")}
    assert tops <= {"shardprep", "shardprep_dagster"} and (tops or editable), tops
    requires = [r for r in dist.requires or [] if "extra ==" not in r]
    assert not [r for r in requires if r.lower().startswith(("dagster", "celery", "psycopg", "redis"))], requires
    for name in ("assets", "resources", "sensors", "orchestration", "definitions"):  # nothing generic installed
        out = subprocess.run([sys.executable, "-c", f"import {name}"], cwd="/", capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": ""}, timeout=60)
        assert out.returncode != 0 and "No module named" in out.stderr, name


def test_the_core_and_its_loaders_work_where_dagster_is_not_installed(tmp_path):
    """Training code installs the core alone: every core module (the dataloaders included) imports, and
    the core reads a shard's samples, in a process where the Dagster side cannot be imported at all."""
    import webdataset as wds

    tar = tmp_path / "00000.tar"
    with wds.TarWriter(str(tar)) as sink:
        for i in range(3):
            sink.write({"__key__": f"00000000{i}", "txt": f"caption {i}", "json": "{}"})
    names = [".".join(p.relative_to(CHECKOUT).with_suffix("").parts).removesuffix(".__init__")
             for p in _modules("shardprep")]
    blocked = sorted(DAGSTER_SIDE - {"tests", "demo", "bench"})
    code = ("import importlib, importlib.abc, sys\n"
            "class NoDagster(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.split('.')[0] in {blocked!r}:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r} (not installed)')\n"
            "sys.meta_path.insert(0, NoDagster())\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "from shardprep.tars import iter_samples\n"
            f"print(sorted(s['txt'].decode() for s in iter_samples({str(tar)!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "['caption 0', 'caption 1', 'caption 2']"


def test_the_shardprep_command_is_the_dagster_sides():
    script = Path(sys.executable).parent / "shardprep"
    assert "shardprep_dagster.orchestration.cli" in script.read_text()
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0 and "reshard" in out.stdout


HEAVY = ("dagster", "torch", "transformers", "faiss", "av", "cv2", "pandas")


@pytest.mark.parametrize("argv", [["--help"], ["verify", "--help"], ["status"]])
def test_status_and_help_import_no_dagster_and_no_engine(tmp_path, argv):
    """`shardprep status` reads the state index (shardprep.state); it and the help texts never import
    Dagster, torch, transformers, faiss, PyAV, OpenCV (issue 20, item 7) or pandas."""
    (tmp_path / "c.yaml").write_text(f"source: {tmp_path}/none/*.parquet\noutput_root: {tmp_path}/out\n")
    if argv == ["status"]:
        argv = ["status", "--config", str(tmp_path / "c.yaml")]
    code = ("import sys\nfrom shardprep_dagster.orchestration.cli import main\n"
            f"try:\n    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
            f"loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
            "print('LOADED', loaded, code)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] in ("LOADED [] 0", "LOADED [] None"), out.stdout[-2000:]
    if argv[0] == "status":
        assert "image_shards" in out.stdout and not (tmp_path / "out").exists()  # shown, nothing written



def test_shardprep_run_starts_its_daemon_before_any_heavy_import(tmp_path):
    """`shardprep run` starts its queue daemon first thing (``cli._start_daemon_early``): every import before
    the daemon's spawn delays the daemon's own imports, which lie on the path to the first run. The modules
    it takes the instance's folder from import the standard library only (``orchestration.home``; through
    ``orchestration.instance`` they imported fsspec, pydantic and the storage layer: the daemon started
    ~0.13 s later, bench/E2E.md)."""
    code = ("import sys\nfrom shardprep_dagster.orchestration import cli, daemon_process\n"
            "seen = []\n"
            "def start_early(home, wait_for_go=False):\n"
            "    seen.append(sorted({m.split('.')[0] for m in sys.modules} & {'dagster', 'fsspec', 'pydantic', "
            "'pyarrow', 'numpy', 'yaml', 'sqlalchemy', 'shardprep'}))\n"
            "daemon_process.start_early = start_early\n"
            f"try:\n    cli._start_daemon_early({str(tmp_path / 'missing.yaml')!r})\nexcept Exception:\n    pass\n"
            "print('AT SPAWN', seen)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DAGSTER_HOME": str(tmp_path / "home")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "AT SPAWN [[]]", out.stdout[-2000:]

LAYERS = {"shardprep": 0, "resources": 1, "assets": 2, "sensors": 3, "definitions": 4, "orchestration": 5}


def _module_graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports, function-level imports included (a lazy import
    hides a circle from the interpreter, not from a reader). ``from package import submodule`` depends on
    the submodule only."""
    mods = {".".join(p.relative_to(CHECKOUT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in _modules(*PRODUCT)}

    def resolve(name: str) -> str | None:
        name = name.removeprefix("shardprep_dagster.")  # the Dagster side's installed name
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] if node.level else [])
                mod = ".".join(p for p in (base, node.module or "") if p) if node.level else node.module or ""
                subs = [f"{mod}.{alias.name}" for alias in node.names]
                targets = subs if all(s in mods for s in subs) else [mod, *subs]
            else:
                continue
            graph[module] |= {r for r in map(resolve, targets) if r and r != module}
    return graph


def test_no_import_circle_and_no_upward_import():
    graph = _module_graph()
    upward = sorted((m, t) for m, ts in graph.items() for t in ts
                    if LAYERS[t.split(".")[0]] > LAYERS[m.split(".")[0]])
    assert upward == [], "a lower layer imports a higher one"
    circles = []
    for start in graph:  # a path back to itself
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node == start:
                circles.append(start)
                break
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
    assert circles == [], f"modules on an import circle: {circles}"
