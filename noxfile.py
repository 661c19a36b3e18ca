"""Sessions that build, test and check the megatron-fsdp workspace.

uv is the virtualenv backend. uv does not read pip's ``PIP_FIND_LINKS``, so it is passed on
as ``UV_FIND_LINKS``: on machines that ship a local CPU torch wheel this keeps uv from
downloading multi-GB CUDA builds.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
README = ROOT / "README.md"
# README.md's install instructions, each a block between `<!-- NAME:begin -->` and
# `<!-- NAME:end -->`: `nox -s build` runs their `pip install` lines exactly as written, each
# block in a fresh venv (tests/test_workspace_structure.py checks what they install).
README_INSTALL_BLOCKS = ["install-from-clone", "install-from-wheels"]
# Bottom layer first: each package may depend only on the ones before it.
LAYERS = [
    "mfsdp-buffers",
    "mfsdp-collectives",
    "mfsdp-hooks",
    "mfsdp-checkpoint",
    "mfsdp-te",
    "megatron-fsdp",
]
LOCAL_TORCH = "2.13"
TORCH_VERSIONS = [LOCAL_TORCH, "2.11", "2.12", "2.15"]
TEST_TOOLS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    "numpy",
    "safetensors>=0.4",
    "transformers>=5.0",
    # megatron_fsdp.integrations (MegatronFSDPTrainer, MegatronFSDPAccelerator).
    "accelerate>=1.10",
    # LoRA adapters (frozen base weights in a unit) in the parity matrix's ecosystem columns.
    "peft>=0.17",
    # test_megatron_fsdp_options_typing runs mypy on snippets with misspelt options.
    "mypy>=1.10",
    # Float8 training whose tensor-subclass parameters the engine must refuse (and, later,
    # shard); it runs on CPU with torch's own _scaled_mm.
    "torchao==0.18.0",  # pinned: each torchao release targets particular torch versions
    # test_megatron_fsdp_trace checks the timeline's JSON against a Trace Event Format schema.
    "jsonschema>=4",
]
# NVIDIA's megatron-fsdp, whose checkpoints we load and which loads ours (nox -s reference).
REFERENCE = "megatron-fsdp==0.6.1"
REFERENCE_DEPS = ["numpy", "einops", "packaging"]
# The Megatron-Core release the adapter (megatron_fsdp.mcore) is tested against.
MEGATRON_CORE = "megatron-core==0.16.1"
if "PIP_FIND_LINKS" in os.environ and "UV_FIND_LINKS" not in os.environ:
    os.environ["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]


def _torch_requirement(version: str) -> str:
    if version == LOCAL_TORCH:
        return f"torch=={LOCAL_TORCH}.*"
    return f"torch=={version}.*"


def _selected_explicitly(name: str) -> bool:
    """True when the command line names this parametrised session, not just its base name."""
    return any(name in arg for arg in sys.argv)


def _install_workspace(
    session: nox.Session, torch_version: str = LOCAL_TORCH, *, bytecode: bool = False
) -> None:
    """``bytecode``: compile every installed module now (uv does not by default), for sessions
    that start many interpreters: each distributed test spawns its ranks, and each imports
    torch and transformers afresh. Where ``PYTHONDONTWRITEBYTECODE`` is set (this project's
    machines) nothing is ever cached otherwise: each import of torch compiled it from source,
    about 3x the time of one from bytecode."""
    env = {"UV_COMPILE_BYTECODE": "1"} if bytecode else {}
    session.install(_torch_requirement(torch_version), *TEST_TOOLS, env=env)
    session.install(*[f"-e{ROOT / 'packages' / layer}" for layer in LAYERS], env=env)
    if bytecode:  # editable installs are not compiled by the installer: the sources are ours
        ours = [str(ROOT / folder) for folder in ("packages", "tests", "benchmarks")]
        session.run("python", "-m", "compileall", "-q", *ours)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    """The whole test suite against one torch version (the local one unless named)."""
    if torch != LOCAL_TORCH and not _selected_explicitly(f"tests(torch='{torch}')"):
        session.skip(f"select with: nox -s \"tests(torch='{torch}')\"")
    _install_workspace(session, torch, bytecode=True)
    _run_suite(session, {})


@nox.session
def tests_full(session: nox.Session) -> None:
    """The whole suite with the full entry-point x feature parity matrix (CI runs a
    cross-section of it; run this before resolving work that touches an entry point)."""
    _install_workspace(session, bytecode=True)
    _run_suite(session, {"MFSDP_FULL_MATRIX": "1"})


SUITE = [
    "packages",
    "tests",
    "benchmarks/test_trackers.py",
    "benchmarks/test_goals.py",
    "benchmarks/test_host_bound.py",
    "benchmarks/test_muon_step.py",
    "benchmarks/test_plan_vs_measured.py",
]


def _run_suite(session: nox.Session, env: dict[str, str]) -> None:
    # --durations: the slowest tests, for keeping CI's cross-section under 25 minutes.
    session.run("python", "-m", "pytest", "--durations=25", *SUITE, *session.posargs, env=env)


@nox.session
def coverage(session: nox.Session) -> None:
    """Which of our source lines the suite runs (CI's cross-section; MFSDP_FULL_MATRIX=1 for
    the whole matrix), rank processes and worker threads included: a line no test runs is an
    untested branch or dead code. Reports each file's unrun lines, least covered first. Not
    recorded: what runs only in a rank that is killed (a dying-rank test; the ranks that
    run_distributed stops once another raised), so check a listed line against the tests."""
    _install_workspace(session, bytecode=True)
    session.install("coverage>=7.10")
    data = ROOT / ".coverage-data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir()
    rc = f"--rcfile={ROOT / 'pyproject.toml'}"
    # Every interpreter the suite starts (each rank, the forkserver) measures itself and
    # writes its own data file (pyproject.toml's [tool.coverage.run] says how).
    env = {"COVERAGE_PROCESS_START": str(ROOT / "pyproject.toml"), "COVERAGE_FILE": f"{data}/c"}
    pytest = ["-m", "pytest", "-q", *SUITE, *session.posargs]
    session.run("python", "-m", "coverage", "run", rc, *pytest, env=env)
    session.run("python", "-m", "coverage", "combine", rc, "-q", env=env)
    session.run("python", "-m", "coverage", "report", rc, "--sort=cover", "--skip-covered", env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on each package's sources, one package at a time."""
    _install_workspace(session)
    session.install("mypy>=1.10", "matplotlib")
    for layer in LAYERS:
        session.run("mypy", "--strict", str(ROOT / "packages" / layer / "src"))
    session.run("mypy", "--strict", str(ROOT / "benchmarks"))
    session.run("mypy", "--strict", str(ROOT / "scripts"))


def _build_all(session: nox.Session, dist: Path) -> None:
    session.install("build>=1.2", "uv")
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    for layer in LAYERS:
        session.run(
            "python",
            "-m",
            "build",
            "--installer",
            "uv",
            "--outdir",
            str(dist),
            str(ROOT / "packages" / layer),
        )


def _wheel_requirements(dist: Path) -> dict[str, list[str]]:
    """``Requires-Dist`` of every wheel in ``dist``, by normalised project name."""
    found: dict[str, list[str]] = {}
    for wheel in sorted(dist.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            message = email.parser.Parser().parsestr(archive.read(meta).decode())
        name = message["Name"].lower().replace("_", "-")
        found[name] = [r for r in message.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return found


def _third_party_requirements(dist: Path, package: str) -> list[str]:
    """What ``package`` needs from outside this workspace, following our own dependencies."""
    ours = _wheel_requirements(dist)
    needed: list[str] = []
    todo, seen = [package], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in ours[name]:
            dep = re.split(r"[\s=<>!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
            if dep in ours:
                todo.append(dep)
            elif requirement not in needed and dep != "torch":
                needed.append(requirement)
    return needed


def _install_from_dist(
    session: nox.Session, python: str, dist: Path, package: str, *tools: str
) -> None:
    """Install ``package`` and the layers it depends on from ``dist`` only.

    Third-party requirements (torch, what our wheels declare, test tools) go in first from the
    usual indexes; ours then resolve with ``--no-index``, so a same-named project on PyPI can
    never stand in for them.
    """
    uv_install = ["uv", "pip", "install", "--quiet", "--python", python]
    third_party = _third_party_requirements(dist, package)
    session.run(*uv_install, _torch_requirement(LOCAL_TORCH), *third_party, *tools, external=True)
    session.run(
        *uv_install, "--refresh", "--no-index", "--find-links", str(dist), package, external=True
    )


def _fresh_venv(session: nox.Session, name: str) -> str:
    venv = Path(session.create_tmp()) / name
    session.run("uv", "venv", "--quiet", "--clear", str(venv), external=True)
    return str(venv / "bin" / "python")


@nox.session
def standalone(session: nox.Session) -> None:
    """Each layer in a fresh venv with only its declared dependencies, then its own tests."""
    dist = Path(session.create_tmp()) / "dist"
    _build_all(session, dist)
    for layer in LAYERS:
        py = _fresh_venv(session, f"venv-{layer}")
        _install_from_dist(session, py, dist, layer, *TEST_TOOLS)
        tests = str(ROOT / "packages" / layer / "tests")
        session.run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests, external=True)


def readme_install_lines(block: str, readme: Path = README) -> list[str]:
    """The ``pip install`` lines of ``readme`` between ``<!-- block:begin -->`` and
    ``<!-- block:end -->``, as written there."""
    text = readme.read_text()
    begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    if begin not in text or end not in text.split(begin, 1)[1]:
        raise ValueError(f"{readme.name} has no {begin} ... {end} block")
    body = text.split(begin, 1)[1].split(end, 1)[0]
    lines = [line.strip() for line in body.splitlines() if line.strip().startswith("pip install")]
    if not lines:
        raise ValueError(f"{readme.name}: the {block} block has no pip install line")
    return lines


def _pip_torch_arguments() -> list[str]:
    """``pip install`` arguments for the local torch. With ``PIP_FIND_LINKS`` holding a torch
    wheel of the local release, its exact version (``2.13.0+cpu``): no index has that, so pip
    cannot prefer a CUDA build of a later patch release."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    local = sorted(
        wheel.name.split("-")[1]
        for link in links
        for wheel in Path(link).glob(f"torch-{LOCAL_TORCH}.*.whl")
    )
    requirement = f"torch=={local[-1]}" if local else _torch_requirement(LOCAL_TORCH)
    return [*(f"--find-links={link}" for link in links), requirement]


def _run_readme_block(session: nox.Session, block: str) -> None:
    """A fresh venv with pip and the local torch, then ``block``'s install lines run by the
    shell from the repository root, exactly as written, then the smoke import there."""
    venv = Path(session.create_tmp()) / f"venv-readme-{block}"
    session.run("uv", "venv", "--quiet", "--clear", "--seed", str(venv), external=True)
    python = str(venv / "bin" / "python")
    session.run(python, "-m", "pip", "install", "--quiet", *_pip_torch_arguments(), external=True)
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    with session.chdir(ROOT):
        for line in readme_install_lines(block):
            session.log(f"README.md [{block}]: {line}")
            session.run("bash", "-c", line, env=env, external=True)
    session.run(python, str(ROOT / "tests" / "smoke_import.py"), external=True)


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of all six packages into dist/, then install the stack from them;
    then README.md's install lines, exactly as written, each block in a fresh venv."""
    dist = ROOT / "dist"
    _build_all(session, dist)
    py = _fresh_venv(session, "venv-build-check")
    _install_from_dist(session, py, dist, "megatron-fsdp")
    session.run(py, str(ROOT / "tests" / "smoke_import.py"), external=True)
    for block in README_INSTALL_BLOCKS:
        _run_readme_block(session, block)


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmark against torch FSDP2 (see benchmarks/README.md)."""
    _install_workspace(session, bytecode=True)
    session.install("matplotlib")
    session.run("python", str(ROOT / "benchmarks" / "run.py"), *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The checks only a GPU can run (scripts/gpu_check.py): this machine's own torch and
    pytest, nothing installed or downloaded, about 10 minutes; writes gpu_check_out/."""
    session.run("python", str(ROOT / "scripts" / "gpu_check.py"), *session.posargs, external=True)


def _run_example(session: nox.Session, script: str, ranks: int = 2) -> None:
    _install_workspace(session)
    session.run(
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(ROOT / "examples" / script),
        *session.posargs,
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a small GPT trained with FSDP on 2 CPU ranks (torchrun + gloo)."""
    _run_example(session, "train_gpt.py")


@nox.session
def pp(session: nox.Session) -> None:
    """Pipeline parallelism x FSDP: a small GPT on 4 CPU ranks as pp=2 x dp=2 with torch's
    schedules (examples/train_gpt_pp.py; --schedule gpipe|1f1b)."""
    _run_example(session, "train_gpt_pp.py", ranks=4)


@nox.session
def finetune(session: nox.Session) -> None:
    """Hugging Face fine-tuning: a small Llama on 2 CPU ranks with checkpoints, resume after a
    kill and an export that from_pretrained loads (examples/finetune_hf.py)."""
    _run_example(session, "finetune_hf.py")


@nox.session
def hf_trainer(session: nox.Session) -> None:
    """transformers' Trainer over megatron-fsdp: a small Llama on 2 CPU ranks with
    MegatronFSDPTrainer, checkpoints, resume (``-- --resume``) and a save_model that
    from_pretrained loads (examples/hf_trainer.py)."""
    _run_example(session, "hf_trainer.py")


@nox.session
def mcore(session: nox.Session) -> None:
    """Megatron-Core's real GPTModel trained through megatron_fsdp.mcore on 2 CPU ranks and
    compared with one unsharded process (examples/mcore_gpt.py, tests/test_example_mcore_gpt.py),
    and Megatron-Core's interleaved pipeline schedule over chunks sharded by fully_shard_model
    (tests/test_mcore_virtual_pipeline.py), every parallelism through the adapter and its
    fsdp_dtensor checkpoints across layouts and with Megatron-Core's optimizer
    (tests/test_mcore_parallelism.py, tests/test_mcore_fsdp_dtensor.py).
    megatron-core installs and imports on CPU; Transformer Engine and apex are not needed."""
    _install_workspace(session)
    # einops: parallel_state's groups for num_distributed_optimizer_instances > 1.
    session.install(MEGATRON_CORE, "einops")
    tests = [
        "test_example_mcore_gpt.py",
        "test_mcore_virtual_pipeline.py",
        "test_mcore_parallelism.py",
        "test_mcore_fsdp_dtensor.py",
    ]
    session.run("pytest", "-q", "-p", "no:cacheprovider", *(str(ROOT / "tests" / t) for t in tests))


@nox.session
def reference(session: nox.Session) -> None:
    """NVIDIA megatron-fsdp 0.6.1 resumes from our checkpoint: ours trains the toy run of
    tests/reference_fixture.py on 3 ranks and saves with naming="nvidia"; the reference, in a
    venv of its own (it shares our import name), loads it with its README's snippet on 2 ranks
    and must continue the one-process curve (tests/data/megatron_fsdp_0_6_1/)."""
    _install_workspace(session)
    here = ROOT / "tests" / "data" / "megatron_fsdp_0_6_1"
    out = Path(session.create_tmp())
    python = _fresh_venv(session, "venv-reference")
    uv_install = ["uv", "pip", "install", "--quiet", "--python", python]
    session.run(*uv_install, _torch_requirement(LOCAL_TORCH), *REFERENCE_DEPS, external=True)
    session.run(*uv_install, "--no-deps", REFERENCE, external=True)
    for kind in ("sgd", "adamw"):
        ours = str(out / f"ours_{kind}")
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
        write = [str(here / "write_ours.py"), "--kind", kind, "--out", ours]
        session.run("python", *launch, "3", *write)
        resume = [str(here / "resume_reference.py"), "--kind", kind, "--checkpoint", ours]
        losses = ["--losses-out", str(out / f"resumed_{kind}.json")]
        session.run(python, *launch, "2", *resume, *losses, external=True)
