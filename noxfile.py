"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s bench`, `nox -s demo`.

`nox -s tests_jax` runs the suite with the lowest and the highest JAX that pyproject.toml
allows (`jax>=0.10.2,<0.12`), each with its jaxlib: jax 0.10.2 on Python 3.11 and jax 0.11.2
on Python 3.12 (jax 0.11 needs Python >= 3.12). One of them: `nox -s "tests_jax(0.11.2)"`;
arguments after `--` go to pytest, e.g. `nox -s tests_jax -- tests/test_program.py`.
"""

import nox

nox.options.sessions = ["lint", "tests"]
PYTHON = "3.11"
# The lowest and the highest supported JAX (keep in step with pyproject.toml's pin), each
# with the oldest Python it supports among ours.
JAX_RANGE = [("3.11", "0.10.2"), ("3.12", "0.11.2")]


@nox.session(python=PYTHON)
def tests(session):
    """The test suite (CPU only, 8 virtual devices)."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
@nox.parametrize("python,jax", JAX_RANGE, ids=[jax for _, jax in JAX_RANGE])
def tests_jax(session, jax):
    """The test suite with one end of the supported JAX range (`jax` and `jaxlib` pinned)."""
    session.install("-e", ".[test]")
    session.install(f"jax=={jax}", f"jaxlib=={jax}")
    session.run("python", "-c", f"import jax, jaxlib; assert jax.__version__ == "
                f"jaxlib.__version__ == {jax!r}, (jax.__version__, jaxlib.__version__)")
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
                   "benchmarks/bench_pipeline.py", "benchmarks/bench_zoo.py",
                   "benchmarks/bench_executable_cache.py"):
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
