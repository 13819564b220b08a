"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s bench`, `nox -s demo`."""

import nox

nox.options.sessions = ["lint", "tests"]
PYTHON = "3.11"


@nox.session(python=PYTHON)
def tests(session):
    """The test suite (CPU only, 8 virtual devices)."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session):
    """ruff: lint and import order."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def bench(session):
    """The benchmarks; figures go into BENCHMARKS.md."""
    session.install("-e", ".")
    for script in ("benchmarks/bench_single_ipu.py", "benchmarks/bench_ga_replication.py",
                   "benchmarks/bench_pipeline.py", "benchmarks/bench_zoo.py"):
        session.run("python", script, *session.posargs)


@nox.session(python=PYTHON)
def demo(session):
    """The demo: trains on virtual IPUs and prints the execution report."""
    session.install(".")
    session.run("keras-ipu", "demo")


@nox.session(python=PYTHON)
def docs(session):
    """The guide: `mkdocs build --strict` (the configuration reference is generated)."""
    session.install("-e", ".[test]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")
