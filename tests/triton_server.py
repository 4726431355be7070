"""A real Triton Inference Server for the tests: the ``tritonserver`` binary that nvidia-pytriton bundles
(its Python API is not used), started on free ports over a model repository and stopped again.

What the bundled server needs to run a Python-backend model from this environment:

- the Python backend's stub built for this interpreter's version: the wheel ships one per version
  (``python_backend_stubs/3.X/``) and the backend looks for it beside ``libtriton_python.so``, so a
  backend directory is assembled with the right one;
- ``nvidia_pytriton.libs`` (libtritonserver, libcudart, ...) on ``LD_LIBRARY_PATH``, and this
  interpreter's own ``libpython3.X.so`` first on it: the stub links ``libpython3.X.so.1.0`` by name and
  would otherwise load the system's, another patch release than the standard library it then runs with;
- this environment's ``bin`` first on ``PATH``: the embedded interpreter finds its prefix from the
  ``python3`` it finds there, so its ``sys.path`` is this virtual environment's (torch, hstu-export).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PYTRITON_VERSION = "0.7.0"
NO_START = "must specify the START flag"  # Triton's refusal of a request of a sequence it does not hold
READY_TIMEOUT_S = 180.0


class ServerSetupError(RuntimeError):
    """The bundled server cannot run in this environment (the message says what is missing)."""


def distribution() -> tuple[Path, Path]:
    """(pytriton's ``tritonserver`` directory, its ``nvidia_pytriton.libs``), found without importing
    pytriton (its Python API pins numpy<2, which this environment does not have)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerSetupError(f"nvidia-pytriton=={PYTRITON_VERSION} is not installed (it bundles tritonserver): "
                               f"pip install --no-deps nvidia-pytriton=={PYTRITON_VERSION}, or `make install`")
    package = Path(next(iter(spec.submodule_search_locations)))
    server, libs = package / "tritonserver", package.parent / "nvidia_pytriton.libs"
    if not (server / "bin" / "tritonserver").is_file() or not libs.is_dir():
        raise ServerSetupError(f"{package} holds no bundled tritonserver and nvidia_pytriton.libs beside it")
    return server, libs


def python_library_dir() -> Path | None:
    """The directory of this interpreter's shared libpython, or None when it is linked statically."""
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and ".so" in soname and (Path(libdir) / soname).exists():
        return Path(libdir)
    return None


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class TritonServer:
    """``tritonserver --model-repository REPO`` on free HTTP, gRPC and metrics ports; its log goes to
    ``workdir/tritonserver.log``. ``start()`` returns once every model is ready; ``stop()`` always ends it."""

    def __init__(self, repository: Path, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.repository, self.workdir = Path(repository), Path(workdir)
        self.extra_env = dict(env or {})  # e.g. CUDA_VISIBLE_DEVICES: the GPUs the server may use
        self.log_path = self.workdir / "tritonserver.log"
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self, tail: int = 3000) -> str:
        """The server's error lines (Triton's ``E`` lines: a model that failed to load says why there) and
        the end of its log."""
        if not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace")
        errors = [line for line in text.splitlines() if re.match(r"E\d{4} ", line)]
        return "error lines:\n" + "\n".join(errors) + f"\n... end of {self.log_path}:\n" + text[-tail:]

    def metrics(self) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
        """The metrics endpoint's samples (Prometheus text): per metric name, per label set, the value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        samples: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
        for line in text.splitlines():
            found = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
            if found is None or line.startswith("#"):
                continue
            labels = frozenset(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"', found[2] or ""))
            samples.setdefault(found[1], {})[labels] = float(found[3])
        return samples

    def _backends(self, server: Path) -> Path:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            raise ServerSetupError(f"pytriton {PYTRITON_VERSION} ships no Python backend stub for Python {version}")
        backend = self.workdir / "backends" / "python"
        backend.mkdir(parents=True, exist_ok=True)
        for source in (server / "backends" / "python" / "libtriton_python.so",
                       server / "backends" / "python" / "triton_python_backend_utils.py", stub):
            shutil.copy2(source, backend / source.name)
        return backend.parent

    def _environment(self, libs: Path) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(p) for p in (python_library_dir(), libs) if p is not None]
        env["LD_LIBRARY_PATH"] = ":".join([*paths, env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env.update(self.extra_env)
        return env

    @staticmethod
    def _check_links(stub: Path, env: dict[str, str]) -> None:
        """Fails naming what the stub cannot find (a Python linked statically and no system libpython)."""
        if shutil.which("ldd") is None:
            return  # the server's log says it then
        linked = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, env=env).stdout
        missing = [line.split()[0] for line in linked.splitlines() if "not found" in line]
        if missing:
            raise ServerSetupError(f"the Python backend stub {stub} cannot find {', '.join(missing)}: a Python "
                                   "built with --enable-shared, or the system's (apt-get install "
                                   f"libpython{sys.version_info.major}.{sys.version_info.minor}), provides it")

    def stub_libraries(self) -> set[str]:
        """The libpython files the running backend stubs have mapped (read from /proc)."""
        assert self.process is not None
        found: set[str] = set()
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit() or os.getpgid(int(entry.name)) != self.process.pid:
                    continue
                if not (entry / "exe").resolve().name == "triton_python_backend_stub":
                    continue
                maps = (entry / "maps").read_text()
            except (OSError, ProcessLookupError):
                continue  # gone meanwhile, or not ours to read
            found |= {line.split()[-1] for line in maps.splitlines() if "/libpython" in line}
        return found

    def start(self) -> TritonServer:
        server, libs = distribution()
        backends = self._backends(server)
        env = self._environment(libs)
        self._check_links(backends / "python" / "triton_python_backend_stub", env)
        command = [str(server / "bin" / "tritonserver"), f"--model-repository={self.repository}",
                   f"--backend-directory={backends}", f"--http-port={self.http_port}",
                   f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
                   # The config is used as written (no completion from model.py) and a model that fails to
                   # load stops the server at once.
                   "--disable-auto-complete-config", "--exit-on-error=true", "--strict-readiness=true"]
        with open(self.log_path, "wb") as log:
            # Its own process group: stop() ends the server and the backend stubs it started.
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ServerSetupError(f"tritonserver exited with status {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise ServerSetupError(f"tritonserver not ready after {READY_TIMEOUT_S:.0f} s:\n{self.log()}")

    def __enter__(self) -> TritonServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is None:
            return
        group = self.process.pid  # start_new_session: the group id is the server's pid
        if self.process.poll() is None:
            os.killpg(group, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # what is left of the group: a server that did not stop, a stub that outlived it
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


def request_inputs(client: Any, request: dict[str, Any], rows: int = 1,
                   datatypes: dict[str, str] | None = None) -> list[Any]:
    """tritonclient inputs (``client``: tritonclient.http or .grpc) for one package request: every feature
    as [rows, n] (one package request is one Triton batch element: rows=1)."""
    import numpy as np

    inputs = []
    for name, tensor in request.items():
        datatype = (datatypes or {}).get(name, "INT64")
        array = tensor.unsqueeze(0).expand(rows, *tensor.shape).numpy().astype(np.dtype(datatype.lower()))
        tensor_input = client.InferInput(name, list(array.shape), datatype)
        tensor_input.set_data_from_numpy(array)
        inputs.append(tensor_input)
    return inputs


# Triton's names of the tensor data types the packages take and return (KServe v2 binary tensors).
TORCH_TYPES = {"INT64": "int64", "INT32": "int32", "FP32": "float32", "BF16": "bfloat16", "FP16": "float16",
               "FP64": "float64", "BOOL": "bool"}


class InferenceRefused(RuntimeError):
    """The server answered a request with an error (its words are the message)."""


class HttpInference:
    """A client of one model over Triton's HTTP protocol with binary tensors (the KServe v2 binary extension),
    built on ``http.client`` alone: it runs where tritonclient is not installed (the GPU machine). One
    keep-alive connection; not thread-safe (one per thread). Inputs go as ``[1, n, ...]`` (one package
    request is one Triton batch element), outputs come back as ``[n, ...]`` torch tensors."""

    def __init__(self, url: str, model: str, timeout: float = 120.0) -> None:
        import http.client

        host, _, port = url.rpartition(":")
        self.model, self.path = model, f"/v2/models/{model}/infer"
        self.connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
        config = self._get(f"/v2/models/{model}/config")
        self.input_types = {i["name"]: i["data_type"].removeprefix("TYPE_") for i in config["input"]}
        self.output_names = [o["name"] for o in config["output"]]

    def _get(self, path: str) -> Any:
        import json

        self.connection.request("GET", path)
        answer = self.connection.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise InferenceRefused(f"GET {path}: HTTP {answer.status}: {body[:300]!r}")
        return json.loads(body)

    def infer(self, request: dict[str, Any], sequence_id: int | None = None,
              sequence_start: bool = False) -> dict[str, Any]:
        return self.post(self.encode(request, sequence_id, sequence_start))

    def encode(self, request: dict[str, Any], sequence_id: int | None = None,
               sequence_start: bool = False) -> tuple[bytes, int]:
        """The request's body and the length of its JSON header (``post`` sends it): one user's request named
        by ``sequence_id`` (the correlation id) for a KV-cached model, with the START flag when asked."""
        import json

        import numpy as np

        header: dict[str, Any] = {"inputs": [], "outputs": [{"name": n, "parameters": {"binary_data": True}}
                                                           for n in self.output_names]}
        if sequence_id is not None:
            header["parameters"] = {"sequence_id": sequence_id, "sequence_start": sequence_start}
        blobs = []
        for name, tensor in request.items():
            datatype = self.input_types[name]
            array = np.ascontiguousarray(tensor.cpu().numpy().astype(TORCH_TYPES[datatype]))
            blobs.append(array.tobytes())
            header["inputs"].append({"name": name, "shape": [1, *array.shape], "datatype": datatype,
                                     "parameters": {"binary_data_size": len(blobs[-1])}})
        head = json.dumps(header).encode()
        return b"".join([head, *blobs]), len(head)

    def post(self, encoded: tuple[bytes, int]) -> dict[str, Any]:
        """Sends a request ``encode`` made; its outputs by name, or InferenceRefused with the server's words."""
        import json

        import torch

        body, head = encoded
        self.connection.request("POST", self.path, body=body,
                                headers={"Inference-Header-Content-Length": str(head),
                                         "Content-Type": "application/octet-stream"})
        answer = self.connection.getresponse()
        body = answer.read()
        if answer.status != 200:
            try:
                words = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                words = body[:300].decode(errors="replace")
            raise InferenceRefused(words)
        length = int(answer.getheader("Inference-Header-Content-Length") or len(body))
        meta, offset, outputs = json.loads(body[:length]), length, {}
        for output in meta["outputs"]:
            size = int(output["parameters"]["binary_data_size"])
            dtype = getattr(torch, TORCH_TYPES[output["datatype"]])
            values = (torch.frombuffer(bytearray(body[offset:offset + size]), dtype=dtype) if size
                      else torch.empty(0, dtype=dtype))  # frombuffer refuses an empty buffer
            outputs[output["name"]] = values.reshape(output["shape"])[0]
            offset += size
        return outputs

    def close(self) -> None:
        self.connection.close()
