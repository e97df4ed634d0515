"""A hub id as model.path is downloaded by huggingface_hub's own snapshot_download into the Hugging Face cache, once,
before Ray starts, and the run reads that snapshot: run as documented against a local HTTP server that answers
the hub's API as huggingface_hub calls it (``HF_ENDPOINT``), serving a tiny random-weight checkpoint made here.
With HF_HUB_OFFLINE=1 (or model.download=false) an id not in the cache is refused with the command to run."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from storage.manifest import MANIFEST_FILE
from tests.conftest import REPO_ROOT
from tests.helpers import (
    assert_every_sample_once,
    hf_hidden_states,
    load_hf_model,
    python_env,
    read_all,
    session_ray_address,
)

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"
TIMEOUT_S = 600


class LocalHub(http.server.ThreadingHTTPServer):
    """The hub's endpoints that snapshot_download uses (huggingface_hub 1.x): the revision's info
    (``/api/models/{id}/revision/{rev}``), its file tree (``/api/models/{id}/tree/{rev}``) and each file
    (``HEAD``/``GET /{id}/resolve/{rev}/{file}``, with the commit, etag and size headers it reads); any other
    id is 404 as on the hub. ``requests`` lists what was asked."""

    def __init__(self, repo_id: str, directory: Path) -> None:
        self.repo_id = repo_id
        self.files = {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}
        self.requests: list[str] = []
        super().__init__(("127.0.0.1", 0), _HubHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _HubHandler(http.server.BaseHTTPRequestHandler):
    server: LocalHub

    def log_message(self, *args) -> None:  # the requests are kept in server.requests
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        hub, path = self.server, unquote(urlparse(self.path).path)
        hub.requests.append(f"{self.command} {path}")
        repo = re.escape(hub.repo_id)
        if re.fullmatch(rf"/api/models/{repo}/revision/[^/]+", path):
            self._send(json.dumps({"id": hub.repo_id, "sha": COMMIT, "private": False,
                                   "siblings": [{"rfilename": name} for name in hub.files]}).encode(), body)
        elif re.fullmatch(rf"/api/models/{repo}/tree/[^/]+", path):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in hub.files.items()]
            self._send(json.dumps(tree).encode(), body)
        elif (match := re.fullmatch(rf"/{repo}/resolve/[^/]+/(.+)", path)) and match.group(1) in hub.files:
            data = hub.files[match.group(1)]
            self._send(data, body, {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": COMMIT})
        else:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

    def _send(self, data: bytes, body: bool, headers: dict[str, str] | None = None) -> None:
        self.send_response(200)
        for key, value in {"Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture
def local_hub(llama_fp32):
    hub = LocalHub(REPO_ID, llama_fp32)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    yield hub
    hub.shutdown()
    hub.server_close()


def hub_env(hf_home: Path, hub: LocalHub | None = None, **extra: str) -> dict[str, str]:
    """The user's shell: HF_HOME in the test's directory, the hub at ``hub`` (none: nothing listens there)."""
    env = python_env(HF_HOME=str(hf_home), HF_ENDPOINT=hub.url if hub else "http://127.0.0.1:9", **extra)
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        env.pop(key, None)
    return env


def run(module: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_a_hub_id_is_downloaded_once_into_the_cache_and_extracted_from_it(ray_cluster, local_hub, llama_fp32,
                                                                          demo_dataset, tmp_path):
    """jobs.plan fetches config.json alone; jobs.extract then fetches the rest, once, and its states are those of the
    checkpoint served (HF transformers' hidden states of the original directory); its rerun downloads nothing."""
    hf_home, out = tmp_path / "hf", tmp_path / "states"
    env = hub_env(hf_home, local_hub, HF_HUB_OFFLINE="0")
    snapshot = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    args = [f"model.path={REPO_ID}", f"data.path={demo_dataset}", f"output.dir={out}", "model.device=cpu",
            "model.dtype=float32", "output.min_free=1GB"]

    plan = run("jobs.plan", args, env)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"model    {snapshot}: LlamaForCausalLM" in plan.stdout, plan.stdout
    assert sorted(path.name for path in snapshot.iterdir()) == ["config.json"]

    args.append(f"ray.address={session_ray_address()}")
    extract = run("jobs.extract", args, env)
    assert extract.returncode == 0, extract.stderr[-3000:]
    served = sorted(local_hub.files)
    assert sorted(path.name for path in snapshot.iterdir()) == served
    for name in served:  # huggingface_hub's layout: the snapshot links to blobs named by their etag
        assert (snapshot / name).read_bytes() == (llama_fp32 / name).read_bytes(), name
        assert (snapshot / name).resolve().parent.name == "blobs"
    assert (snapshot.parents[1] / "refs" / "main").read_text() == COMMIT
    downloads = [request for request in local_hub.requests if request.startswith("GET /tiny-org")]
    assert sorted(downloads) == sorted(f"GET /{REPO_ID}/resolve/{COMMIT}/{name}" for name in served), downloads

    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["content"]["model.path"] == str(snapshot)
    assert_every_sample_once(out, demo_dataset)
    first = min(read_all(out).items())[1]
    reference = hf_hidden_states(load_hf_model(llama_fp32), first.input_ids.numpy())
    layer_ids = manifest["content"]["extract.layers"]
    hidden = first.aux_hidden_states.shape[1] // len(layer_ids)
    for j, k in enumerate(layer_ids):
        got = first.aux_hidden_states[:, j * hidden : (j + 1) * hidden].float()
        assert (got - reference[k + 1]).abs().max() < 1e-4, f"layer {k}"

    local_hub.requests.clear()
    again = run("jobs.extract", args, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [request for request in local_hub.requests if request.startswith("GET /tiny-org")], local_hub.requests


@pytest.mark.parametrize("setting, said", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set, so nothing is downloaded. Download it where the hub is "
                              f"reachable (HF_HUB_OFFLINE=0 hf download {REPO_ID}, into this cache)"),
    ({"HF_HUB_OFFLINE": "0", "download": "false"}, f" (nothing is downloaded here). Download it first (hf download {REPO_ID})"),
], ids=["HF_HUB_OFFLINE=1", "model.download=false"])
def test_without_downloading_an_id_not_in_the_cache_is_refused_with_the_command(local_hub, demo_dataset, tmp_path,
                                                                                 setting, said):
    """Offline mode (or model.download=false) is respected: nothing asked of the hub, one line with the command."""
    env = hub_env(tmp_path / "hf", local_hub, HF_HUB_OFFLINE=setting["HF_HUB_OFFLINE"])
    args = [f"model.path={REPO_ID}", f"data.path={demo_dataset}", f"output.dir={tmp_path / 'out'}"]
    if "download" in setting:
        args.append(f"model.download={setting['download']}")
    refused = run("jobs.plan", args, env)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    (line,) = refused.stderr.splitlines()
    assert line.startswith(f"error: model.path={REPO_ID}: no such directory, and no complete snapshot of it in "
                           f"the local Hugging Face cache ({tmp_path / 'hf' / 'hub'})") and said in line, line
    assert local_hub.requests == [] and not (tmp_path / "out").exists()


def test_an_unreachable_hub_or_an_unknown_id_is_refused_naming_the_endpoint(local_hub, demo_dataset, tmp_path):
    args = [f"data.path={demo_dataset}", f"output.dir={tmp_path / 'out'}"]
    unknown = run("jobs.plan", ["model.path=tiny-org/no-such-model", *args],
                  hub_env(tmp_path / "hf", local_hub, HF_HUB_OFFLINE="0"))
    assert unknown.returncode == 2, unknown.stderr
    assert f"the download from {local_hub.url} failed (RepositoryNotFoundError" in unknown.stderr, unknown.stderr
    unreachable = run("jobs.plan", [f"model.path={REPO_ID}", *args], hub_env(tmp_path / "hf", None, HF_HUB_OFFLINE="0"))
    assert unreachable.returncode == 2, unreachable.stderr
    assert "the download from http://127.0.0.1:9 failed" in unreachable.stderr
    assert f"hf download {REPO_ID}" in unreachable.stderr and len(unreachable.stderr.splitlines()) == 1


NODE_START = "import sys; from extractor.checkpoint import checkpoint_on_this_node as on; print(on(sys.argv[1], True))"


def test_a_node_without_the_drivers_snapshot_downloads_that_commit_itself(local_hub, llama_fp32, tmp_path):
    """What the extractor (and the regeneration engine) does first on its node, before SGLang loads: the driver's
    snapshot path, absent there (another machine, its own cache), becomes that commit downloaded into the node's
    own cache; offline, it is one line naming the command for each node. (One machine here: the node's cache is
    another directory.)"""
    driver_snapshot = tmp_path / "driver-hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    node_home = tmp_path / "node-hf"
    node = subprocess.run([sys.executable, "-c", NODE_START, str(driver_snapshot)], cwd=REPO_ROOT,
                          env=hub_env(node_home, local_hub, HF_HUB_OFFLINE="0"), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert node.returncode == 0, node.stderr[-3000:]
    here = Path(node.stdout.strip())
    assert here == node_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert {path.name: path.read_bytes() for path in here.iterdir()} == local_hub.files
    assert f"GET /api/models/{REPO_ID}/tree/{COMMIT}" in local_hub.requests  # that commit, not main's latest

    offline = subprocess.run([sys.executable, "-c", NODE_START, str(driver_snapshot)], cwd=REPO_ROOT,
                             env=hub_env(tmp_path / "other-hf", local_hub, HF_HUB_OFFLINE="1"), capture_output=True,
                             text=True, timeout=TIMEOUT_S)
    assert offline.returncode != 0
    assert (f"the driver's snapshot of {REPO_ID} is not on this node" in offline.stderr and
            f"(hf download {REPO_ID} --revision {COMMIT}) or share one Hugging Face cache (HF_HOME)" in offline.stderr)
