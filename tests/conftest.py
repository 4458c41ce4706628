"""Shared fixtures: real tiny MLX models created offline, once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory: pytest.TempPathFactory):
    """`factory(arch, size="tiny", dtype="float32") -> Path`, each model made once."""
    from kvcellar.engine.demo_models import create_model

    made: dict[tuple[str, str, str], Path] = {}
    root = tmp_path_factory.mktemp("models")

    def factory(arch: str, size: str = "tiny", dtype: str = "float32") -> Path:
        key = (arch, size, dtype)
        if key not in made:
            made[key] = create_model(arch, root / f"{arch}-{size}-{dtype}", size=size, dtype=dtype)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def loaded_model_factory(model_dir_factory):
    """`factory(arch, size="tiny", dtype="float32") -> (model, tokenizer)`, loaded once."""
    from mlx_lm import load

    loaded: dict[tuple[str, str, str], tuple] = {}

    def factory(arch: str, size: str = "tiny", dtype: str = "float32"):
        key = (arch, size, dtype)
        if key not in loaded:
            loaded[key] = load(str(model_dir_factory(arch, size, dtype)))
        return loaded[key]

    return factory


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a tool-and-thinking chat format (Qwen3-style template), made once."""
    from kvcellar.engine.demo_models import create_model

    return create_model("llama", tmp_path_factory.mktemp("tools-model") / "llama-tools", chat_format="tools")


@pytest.fixture(scope="session")
def tools_tokenizer(tools_model_dir: Path):
    """mlx-lm's tokenizer wrapper of `tools_model_dir` (it infers the tool parser and thinking markers)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(tools_model_dir)


# The longest tests go first: pytest-xdist hands tests out in collection order,
# so a multi-minute sweep collected last would leave the other worker idle at the end.
# The real agent clients (minutes each, a cold ~28k-token prefill among them) lead.
AGENT_CLIENT_TESTS = ("tests/test_agent_clients",)
LONG_TESTS_FIRST = (
    "tests/test_simulations.py::test_the_default_sweep",
    "tests/test_sim_crash_images.py::test_the_default_sweep",
    "tests/test_checkpoint_serve.py",
    "tests/test_cluster.py",
    "tests/test_bench_",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> tuple[bool, bool]:
        return not item.nodeid.startswith(AGENT_CLIENT_TESTS), not item.nodeid.startswith(LONG_TESTS_FIRST)

    items.sort(key=rank)


@pytest.fixture
def rings(tmp_path):
    """Two key rings of fresh keys, (right, wrong): the sealed-tier tests seal with one and open with the other."""
    from kvcellar.store.keyring import load_key_ring, write_new_key_file

    keys = tmp_path / "keys"
    keys.mkdir()
    write_new_key_file(keys / "right.key")
    write_new_key_file(keys / "wrong.key")
    return load_key_ring([keys / "right.key"]), load_key_ring([keys / "wrong.key"])
