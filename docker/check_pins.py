"""`make docker-check`: does the GPU image's package set exist, and agree on one CUDA major?

For each rollout engine the image can be built for (docker/Dockerfile's ROLLOUT_EXTRA), pip resolves
exactly what the image installs, docker/requirements/<engine>.txt plus megarl with that extra, for
Linux x86-64 / CPython 3.12 without installing anything (`pip install --dry-run --report`). The check
then fails, naming the package, when
  - a pin has no wheel for that platform (or pip cannot resolve the set at all),
  - torch, vLLM, SGLang or Transformer-Engine is built for another CUDA major than the others or
    than the base image (nvidia/cuda:<version> in the Dockerfile),
  - a package the image compiles from source (docker/requirements/source.txt) has no release,
  - the Dockerfile installs a Python the base image's Ubuntu does not ship.

A package's CUDA major is read from what it requires (nvidia-nccl-cu13, transformer_engine_cu13,
cuda-toolkit==13.0.3, flashinfer_python[cu13], ...) and from its local version (torch 2.14.0+cu129).

Run it under CPython 3.12: pip evaluates environment markers (python_version < "3.12") with the
interpreter it runs under, whatever --python-version says; `make docker-check` makes that venv.
Cost: pip reads each wheel's metadata alone, never the wheel. pypi.org serves it as a file of its own
(PEP 658); an index without it (the registry mirror of the development machines) would make pip
download every wheel of the set, about 3 GB per engine (9 to 13 minutes for both on 2 cores), so pip
runs with `--use-feature=fast-deps`: it reads a wheel's METADATA out of the zip with HTTP range
requests (its central directory, then that one member). Measured on the mirror (2026-12-05): vllm
247 packages in 29 s, sglang 255 packages in 34 s, 107 MB for the sglang set (small wheels and sdists
are still fetched whole) instead of about 3 GB. An index without range requests makes pip fall back
to downloading. The engines resolve in parallel, and each report is kept in runs/docker-check/ under
a hash of its inputs, so an unchanged set is not resolved again.

    python docker/check_pins.py [--dockerfile docker/Dockerfile] [--requirements DIR] [--engines vllm sglang]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PYTHON = "3.12"
# pip matches --platform tags literally: list every manylinux a glibc 2.39 (Ubuntu 24.04) system accepts.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
# The environment markers are evaluated for (pip itself uses its own interpreter's; see above).
TARGET_ENV = dict(default_environment(), python_version=PYTHON, python_full_version=f"{PYTHON}.3", sys_platform="linux",
                  platform_system="Linux", platform_machine="x86_64", os_name="posix", implementation_name="cpython",
                  platform_python_implementation="CPython")
# Whose CUDA builds must agree (the packages with CUDA code the image loads together).
ROOTS = ("torch", "vllm", "sglang", "transformer-engine")
UBUNTU_PYTHON = {"20.04": "3.8", "22.04": "3.10", "24.04": "3.12"}
CACHE = REPO / "runs" / "docker-check"


@dataclass
class Image:
    """What the Dockerfile says about the base image and its Python."""

    cuda: str  # e.g. 13.0.1
    ubuntu: str
    pythons: list[str]  # python3.X the Dockerfile installs or runs

    @property
    def cuda_major(self) -> int:
        return int(self.cuda.split(".")[0])


def parse_dockerfile(text: str) -> Image:
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    m = re.search(r"nvidia/cuda:(\d+\.\d+(?:\.\d+)?)-\S*?ubuntu(\d+\.\d+)", text)
    if m is None:
        raise SystemExit("docker-check: the Dockerfile names no nvidia/cuda:<version>-...-ubuntu<release> base image")
    return Image(m.group(1), m.group(2), sorted(set(re.findall(r"\bpython(3\.\d+)\b", text))))


def image_problems(image: Image) -> list[str]:
    distro = UBUNTU_PYTHON.get(image.ubuntu)
    return [f"python{p}: Ubuntu {image.ubuntu} has no such package (its Python is {distro}); install python{distro}"
            for p in image.pythons if distro and p != distro]


# ------------------------------------------------------------------------------------ CUDA majors
def _cuda_major_of_local(version: str) -> int | None:
    """torch 2.14.0+cu129 -> 12, +cu130 -> 13 (the last digit is the minor)."""
    m = re.search(r"\+cu(\d+)(\d)$", version)
    return int(m.group(1)) if m else None


def _cuda_major_of_requirement(req: Requirement) -> int | None:
    name = canonicalize_name(req.name)
    m = re.search(r"-cu(\d+)$", name)  # nvidia-nccl-cu13, transformer-engine-cu13
    if m:
        return int(m.group(1))
    for extra in req.extras:  # flashinfer_python[cu13], nvidia-cutlass-dsl[cu13], transformer_engine[core_cu13]
        m = re.search(r"(?:^|[-_])cu(\d+)$", extra)
        if m:
            return int(m.group(1))
    if name == "cuda-toolkit":  # cuda-toolkit[cublas,...]==13.0.3
        for spec in req.specifier:
            if spec.operator in ("==", "===", "~=", ">="):
                return Version(spec.version.rstrip(".*")).major
    return None


def active_requirements(metadata: dict, extras: list[str]) -> list[Requirement]:
    """The Requires-Dist lines that apply on the target platform with the requested extras."""
    out = []
    for line in metadata.get("requires_dist", []):
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate(dict(TARGET_ENV, extra=e)) for e in ["", *extras]):
            out.append(req)
    return out


@dataclass
class Build:
    name: str
    version: str
    majors: dict[int, list[str]] = field(default_factory=dict)  # CUDA major -> the evidence

    def describe(self) -> str:
        return ", ".join(f"CUDA {m} ({', '.join(ev[:2])})" for m, ev in sorted(self.majors.items())) or "no CUDA build named"


def cuda_builds(report: dict) -> dict[str, Build]:
    """ROOTS present in a pip --report, each with the CUDA majors its own metadata names."""
    builds = {}
    for item in report["install"]:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        if name not in ROOTS:
            continue
        build = Build(name, meta["version"])
        local = _cuda_major_of_local(meta["version"])
        if local is not None:
            build.majors.setdefault(local, []).append(f"version {meta['version']}")
        for req in active_requirements(meta, [canonicalize_name(e) for e in item.get("requested_extras") or []]):
            major = _cuda_major_of_requirement(req)
            if major is not None:
                cuda_extras = sorted(e for e in req.extras if re.search(r"cu\d+$", e))
                build.majors.setdefault(major, []).append(
                    f"{req.name}{'[' + ','.join(cuda_extras) + ']' if cuda_extras else ''}{req.specifier}")
        builds[name] = build
    return builds


def cuda_problems(builds: dict[str, Build], image: Image, engine: str) -> list[str]:
    problems = []
    for name, build in builds.items():
        if not build.majors:
            problems.append(f"{engine}: {name} {build.version} names no CUDA build (no nvidia-*-cuNN, cuda-toolkit "
                            f"or [cuNN] requirement, no +cuNNN version); cannot check it against CUDA {image.cuda}")
        elif set(build.majors) != {image.cuda_major}:
            problems.append(f"{engine}: {name} {build.version} is built for {build.describe()} but the image is "
                            f"CUDA {image.cuda} (nvidia/cuda:{image.cuda}): pick a {name} release for CUDA "
                            f"{image.cuda_major}, or a base image of its CUDA")
    return problems


# ------------------------------------------------------------------------------------ resolving
def requirement_text(path: Path) -> str:
    """The file with every `-r other.txt` it includes, for the cache key."""
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"\s*-r\s+(\S+)", line)
        out.append(requirement_text(path.parent / m.group(1)) if m else line)
    return "\n".join(out)


def pip_command(requirements: Path, engine: str, report: Path, project: Path) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    # fast-deps: the metadata by HTTP range requests instead of whole wheels (the module docstring's Cost).
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--use-feature=fast-deps", "--quiet",
            "--ignore-installed", "--report", str(report),
            "--python-version", PYTHON, *platforms, "--only-binary=:all:", "-r", str(requirements), f"{project}[{engine}]"]


def pip_failure(stderr: str) -> str:
    """One line naming what pip could not find or reconcile."""
    m = re.search(r"No matching distribution found for (\S+)", stderr)
    if m:
        return f"{m.group(1)}: no wheel for Linux x86-64 / CPython {PYTHON}"
    if "ResolutionImpossible" in stderr or "conflict is caused by" in stderr:
        m = re.search(r"Cannot install (.+?) because", stderr)
        lines = [line.strip() for line in stderr.splitlines() if " depends on " in line or line.strip().startswith("The user requested")]
        return f"the pins conflict{' over ' + m.group(1) if m else ''}: " + ("; ".join(lines[:4]) or "pip names no cause")
    tail = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    return "pip failed: " + " / ".join(tail[-3:])


def report_name(engine: str, requirements: Path, project: Path) -> str:
    """The cached report's file name: a hash of everything that decides the resolution."""
    key = hashlib.sha256("\n".join([requirement_text(requirements), (project / "setup.py").read_text(), engine, PYTHON,
                                    *PLATFORMS]).encode()).hexdigest()[:16]
    return f"{engine}-{key}.json"


def start_resolve(engine: str, requirements: Path, project: Path, cache: Path | None):
    """(cached report path, None) or (report path, running pip process)."""
    if cache is not None:
        path = cache / report_name(engine, requirements, project)
        if path.exists():
            return path, None
        cache.mkdir(parents=True, exist_ok=True)
        target = path
    else:
        target = Path(tempfile.mkdtemp()) / f"{engine}.json"
    partial = target.with_suffix(".partial")
    # The image's pip has no configuration: this machine's pip.conf (extra indexes, constraint files)
    # must not change the answer. The index itself may still come from PIP_INDEX_URL (a CI mirror).
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    proc = subprocess.Popen(pip_command(requirements, engine, partial, project), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    return target, proc


def source_problems(path: Path) -> list[str]:
    """Each pin the image compiles from source must exist as a release (any file) on the index."""
    problems = []
    if not path.exists():
        return problems
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        pins = [s.version for s in req.specifier if s.operator == "=="]
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", req.name], capture_output=True, text=True,
                             env=dict(os.environ, PIP_CONFIG_FILE=os.devnull))
        listed = re.search(r"Available versions: (.*)", out.stdout)
        versions = listed.group(1).replace(",", " ").split() if listed else []
        for pin in pins:
            if pin not in versions:
                problems.append(f"{req.name}=={pin} (built from source in the image): no such release on the index")
    return problems


# ------------------------------------------------------------------------------------ main
def check(dockerfile: Path, requirements: Path, engines: list[str], project: Path = REPO, cache: Path | None = CACHE) -> list[str]:
    """Every problem, one line each (empty: the image's set resolves and agrees)."""
    if sys.version_info[:2] != tuple(map(int, PYTHON.split("."))):
        raise SystemExit(f"docker-check: run under CPython {PYTHON} (pip evaluates markers with its own interpreter, "
                         f"this is {sys.version.split()[0]}); `make docker-check` sets one up")
    image = parse_dockerfile(dockerfile.read_text())
    problems = image_problems(image)
    running = {}
    for engine in engines:
        req = requirements / f"{engine}.txt"
        if not req.exists():
            problems.append(f"{engine}: no {req} (the image's pins for ROLLOUT_EXTRA={engine})")
            continue
        running[engine] = start_resolve(engine, req, project, cache)
    for engine, (path, proc) in running.items():
        if proc is not None:
            _, stderr = proc.communicate()
            if proc.returncode != 0:
                problems.append(f"{engine}: {pip_failure(stderr)}")
                continue
            path.with_suffix(".partial").rename(path)
        report = json.loads(path.read_text())
        builds = cuda_builds(report)
        problems += cuda_problems(builds, image, engine)
        found = ", ".join(f"{b.name} {b.version} {b.describe()}" for b in builds.values())
        print(f"docker-check: {engine}: {len(report['install'])} packages; {found}")
    problems += source_problems(requirements / "source.txt")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dockerfile", type=Path, default=REPO / "docker" / "Dockerfile")
    ap.add_argument("--requirements", type=Path, default=None, help="directory of <engine>.txt (default: beside the Dockerfile)")
    ap.add_argument("--engines", nargs="+", default=["vllm", "sglang"])
    ap.add_argument("--no-cache", action="store_true", help=f"resolve again even when {CACHE} has the report")
    args = ap.parse_args(argv)
    requirements = args.requirements or args.dockerfile.parent / "requirements"
    problems = check(args.dockerfile, requirements, args.engines, cache=None if args.no_cache else CACHE)
    for line in problems:
        print(f"docker-check FAILED: {line}", file=sys.stderr)
    if not problems:
        print(f"docker-check: {args.dockerfile} resolves for CPython {PYTHON} on Linux x86-64 and agrees on one CUDA major")
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
