"""SGLang: the named tensors of an inference rank, as awex's ``sglang`` backend names them."""

from __future__ import annotations

from typing import Any


def named_tensors(model: Any) -> list[tuple[str, Any]]:
    """``[(name, tensor)]`` of an SGLang model, ready for ``Reader.register``.

    ``model`` is the model module (``model_runner.model``, e.g. ``Qwen3ForCausalLM``) or the
    ``ModelRunner`` holding it. Tied embeddings appear once (``model.embed_tokens.weight``), as
    ``named_parameters()`` lists a shared parameter once and as awex's layout expects.
    """
    module = model
    if not hasattr(module, "named_parameters"):
        module = getattr(model, "model", None)
        if module is None or not hasattr(module, "named_parameters"):
            raise TypeError(
                f"expected an SGLang model (an nn.Module) or a ModelRunner with `.model`, not {type(model).__name__}"
            )
    out: list[tuple[str, Any]] = []
    for name, p in module.named_parameters():
        out.append((name.replace("_orig_mod.", ""), p))
    return out


__all__ = ["named_tensors"]
