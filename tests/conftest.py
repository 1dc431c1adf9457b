"""Test-wide setup.

Triton kernels run on the CPU through Triton's interpreter, which must be switched on before any kernel is
defined, so it is set here, before the tests import kvcompile. On a machine with a GPU the real kernels run.

The CUDA subset: ``pytest --device cuda`` runs the tests marked ``device`` -- and only them -- with their
models and tensors on the GPU (they take the ``device`` fixture; without the switch it is the CPU, and they
run in the CPU suite like any other test). Without a CUDA device the switch is refused, saying so.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import profiles  # noqa: E402,F401  (tests/profiles.py: loads the hypothesis profile, fast or thorough)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="cuda: run the CUDA subset (the tests marked 'device') on the GPU, and nothing else")


def pytest_configure(config):
    config.addinivalue_line("markers", "device: runs on the device --device names (pytest --device cuda: the CUDA "
                                       "subset, these tests only); the test takes the `device` fixture")
    if config.getoption("--device") == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"--device cuda: no CUDA device is visible (torch {torch.__version__}: torch.cuda.is_available() is "
            f"False), so the CUDA subset cannot run here. Run it on a machine with a GPU, or leave out --device for "
            f"the CPU suite.")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """Where a ``device``-marked test puts its models and tensors: ``--device`` (the CPU by default)."""
    return torch.device(request.config.getoption("--device"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama saved with SmolLM2's tokenizer (the real tokenizer, a model that runs fast)."""
    import transformers

    from kvcompile import models
    tok = transformers.AutoTokenizer.from_pretrained(models.convert_default(log=lambda *a: None))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id)
    d = tmp_path_factory.mktemp("tiny")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer (byte-level BPE, 49,152 tokens), from the embedded model."""
    import transformers

    from kvcompile import models
    return transformers.AutoTokenizer.from_pretrained(models.convert_default(log=lambda *a: None))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokenizer of about 300 tokens trained here on a few JSON-ish lines (every byte a token of
    its own, as in SmolLM2's; merges such as '{"' and '":' that cross JSON's punctuation), its end token
    ``<|end|>`` special: a second vocabulary, made without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = ['{"name": "cat", "age": 3, "tags": ["a", "b"]}', '{"ok": true, "n": null, "x": -1.5e3}',
             "the quick brown fox jumps over the lazy dog"]
    tok.train_from_iterator(lines * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


@pytest.fixture(scope="session")
def pet_model():
    """A pydantic model of the kinds of fields whose schema (as the openai client's ``parse`` sends it) uses every
    keyword of OpenAI's structured outputs: nested models ($defs and $ref), Optional fields (anyOf with null),
    Literal and Enum fields (const, enums of strings and integers), a dict (additionalProperties)."""
    import enum
    from typing import Literal, Optional

    from pydantic import BaseModel

    class Size(enum.IntEnum):
        S = 1
        M = 2

    class Owner(BaseModel):
        name: str
        age: Optional[int]

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        tag: Literal["x"]
        size: Size
        owner: Optional[Owner]
        friends: list[Owner]
        scores: dict[str, int]

    return Pet


@pytest.fixture(scope="session")
def bounded_model():
    """A pydantic model whose fields bound their values, as people write them: numbers with ``ge`` / ``lt``,
    string and list lengths, a pattern, a date, a datetime, a UUID, a discriminated union (oneOf with a
    discriminator in the schema), a multiple."""
    import datetime
    import uuid
    from typing import Literal, Union

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=1, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        name: str = Field(min_length=1, max_length=6)

    class Booking(BaseModel):
        guests: int = Field(ge=1, lt=13)
        rating: float = Field(gt=0, le=5)
        code: str = Field(pattern=r"^[A-Z]{3}[0-9]$")
        notes: list[str] = Field(min_length=1, max_length=2)
        day: datetime.date
        at: datetime.datetime
        ref: uuid.UUID
        pet: Union[Cat, Dog] = Field(discriminator="kind")
        seats: int = Field(ge=2, le=12, multiple_of=2)

    return Booking


# Under -n (pytest-xdist, a whole file per process at a time: pyproject's --dist loadfile) the files that take
# longest go first, so that none is left running alone at the end (--no-loadscope-reorder keeps this order).
# Seconds in one process on the 2-core machine, 2026-12-03; the other files follow in their usual order.
LONGEST_FILES = {"passes/test_model_families.py": 237, "test_serve_http.py": 187, "test_json_mode.py": 71,
                 "test_generate.py": 164, "test_api.py": 162, "templates/test_attention_kernel.py": 155,
                 "test_smollm2.py": 149, "test_serve_load.py": 134, "templates/test_cpu_kernels.py": 112,
                 "test_serving_compiled.py": 78, "test_serving.py": 73, "test_tp.py": 72, "test_cli.py": 66,
                 "templates/test_store_kernel.py": 63, "test_prerope.py": 55,
                 # estimated from runs on the loaded machine (2026-12-04), at about a sixth of their time there
                 "templates/test_kernels_head_sizes.py": 160, "test_head_sizes.py": 120, "test_hf_cache.py": 60,
                 "test_device.py": 150, "test_exact.py": 120, "test_benchmark_gpu_e2e.py": 25}


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device") == "cuda":  # the CUDA subset: the tests marked `device`, no others
        keep = [item for item in items if item.get_closest_marker("device") is not None]
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("device") is None])
        items[:] = keep
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    here = os.path.dirname(__file__)
    items.sort(key=lambda item: -LONGEST_FILES.get(os.path.relpath(str(item.path), here).replace(os.sep, "/"), 0))
