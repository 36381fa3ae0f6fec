"""The notebooks and the training example run end to end, and are committed without outputs.

Each notebook in notebooks/ is executed headless with nbclient, in a kernel running this
interpreter (working directory notebooks/), and fails on any cell error or after 300 s; two
run at a time (their time is mostly compiling, one core each: on 2 cores 107 s -> 69 s).
The packages they need are the optional extra `notebooks` (03 also `flax`, 05 also
`flax` and `hf`); a missing one is a failure that says so, never a skip. The kernel
inherits the environment, so JAX_ROPE_BACKEND applies to the notebooks as well.
"""

import asyncio
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
EXAMPLE = ROOT / "examples" / "train_tiny_lm.py"
EXPECTED = ("01_quickstart.ipynb", "02_sparse_modes.ipynb", "03_training.ipynb",
            "04_performance.ipynb", "05_hf_port.ipynb")
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
NOTEBOOK_TIMEOUT_S = 300
NOTEBOOKS_AT_ONCE = 2
KERNEL_NAME = "jax-rope-tests-python"
EXTRA = ("nbclient", "nbformat", "ipykernel", "matplotlib", "optax")
# Optional extras some notebooks need beyond 'notebooks': {notebook: {extra: modules}}.
NEEDS = {"03_training.ipynb": {"flax": ("flax",)},
         "05_hf_port.ipynb": {"flax": ("flax",), "hf": ("safetensors", "transformers", "torch")}}


def _missing(modules):
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def require_notebook_extra(name=None):
    """Imports nbclient and nbformat; fails (not skips) if any package of the extras that
    notebook `name` needs is missing."""
    extras = {"notebooks": EXTRA, **NEEDS.get(name, {})}
    missing = {extra: m for extra, modules in extras.items() if (m := _missing(modules))}
    if missing:
        pytest.fail(f"{name or 'the notebook tests'} need "
                    + "; ".join(f"{', '.join(m)} (the optional extra '{extra}')"
                                for extra, m in missing.items())
                    + f": pip install -e '.[{','.join(missing)}]'", pytrace=False)
    return importlib.import_module("nbclient"), importlib.import_module("nbformat")


def test_every_notebook_is_found():
    assert set(EXPECTED) <= set(NOTEBOOKS), f"notebooks/ holds {NOTEBOOKS}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    notebook = json.loads((NOTEBOOK_DIR / name).read_text(encoding="utf-8"))
    dirty = [i for i, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{name}: code cells {dirty} have outputs or an execution count; "
                       f"run `python notebooks/strip_outputs.py`")


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec that starts this very interpreter, found through JUPYTER_PATH."""
    data_dir = tmp_path_factory.mktemp("jupyter")
    spec_dir = data_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python (jax_rope tests)", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    previous = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(data_dir), previous]))
    yield KERNEL_NAME
    if previous is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = previous


async def _execute(nbclient, nbformat, name, kernel_name, slots):
    """(seconds, None) once notebook `name` ran through, (seconds, error) if it did not."""
    async with slots:
        start = time.monotonic()
        sockets = tempfile.mkdtemp(prefix="nb-")  # short: a socket path has ~100 bytes
        try:
            notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
            nbformat.validate(notebook)
            deadline = start + NOTEBOOK_TIMEOUT_S
            # Kernels talk over Unix sockets of their own (absolute paths: the kernel runs
            # in notebooks/): over TCP, a port the client had found free was at times
            # taken (by the other notebook's kernel, or a test running beside this one)
            # before the kernel bound it, which killed the kernel.
            transport = importlib.import_module("traitlets.config").Config()  # nbclient's
            transport.KernelManager.transport = "ipc"
            transport.KernelManager.ip = os.path.join(sockets, "kernel")
            client = nbclient.NotebookClient(
                notebook, kernel_name=kernel_name, startup_timeout=120, config=transport,
                # every cell may use what is left of the notebook's 300 s
                timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
                resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
            await client.async_execute()  # CellExecutionError (with the traceback) on failure
        except Exception as error:  # noqa: BLE001 - raised again by the notebook's test
            return time.monotonic() - start, error
        finally:
            shutil.rmtree(sockets, ignore_errors=True)
        return time.monotonic() - start, None


@pytest.fixture(scope="module")
def notebook_runs(kernel_name):
    """{name: (seconds, error or None)} for every notebook whose extras are installed, run
    NOTEBOOKS_AT_ONCE at a time."""
    nbclient, nbformat = require_notebook_extra()
    names = [name for name in NOTEBOOKS
             if not any(_missing(modules) for modules in NEEDS.get(name, {}).values())]

    async def run_all():
        slots = asyncio.Semaphore(NOTEBOOKS_AT_ONCE)
        return await asyncio.gather(*(_execute(nbclient, nbformat, name, kernel_name, slots)
                                      for name in names))

    return dict(zip(names, asyncio.run(run_all())))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, request):
    require_notebook_extra(name)  # a missing extra fails here, saying which
    elapsed, error = request.getfixturevalue("notebook_runs")[name]
    if error is not None:
        raise error
    print(f"{name}: {elapsed:.1f} s")
    assert elapsed < NOTEBOOK_TIMEOUT_S


def test_train_tiny_lm_script():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "30", "--sample", "20"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "30/30" in result.stdout and "loss: first step" in result.stdout, result.stdout
