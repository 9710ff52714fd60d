//! Canonical (HF checkpoint) tensors as values ([`Canon`]: a part at a layer and expert), and
//! each family's HF spelling of them ([`HfNames`]), in one place.

use super::part::Part;

/// A canonical (HF checkpoint) tensor, identified without its string name: a [`Part`] at a
/// layer (per-layer parts) and an expert (per-expert parts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Canon {
    /// What the tensor is.
    pub part: Part,
    layer: u64,
    expert: u64,
}

impl Canon {
    /// A tensor outside the layers (embedding, final norm, output projection).
    pub const fn global(part: Part) -> Canon {
        Canon {
            part,
            layer: 0,
            expert: 0,
        }
    }

    /// A tensor of layer `l`.
    pub const fn at(part: Part, l: u64) -> Canon {
        Canon {
            part,
            layer: l,
            expert: 0,
        }
    }

    /// A tensor of routed expert `e` of layer `l`.
    pub const fn expert_at(part: Part, l: u64, e: u64) -> Canon {
        Canon {
            part,
            layer: l,
            expert: e,
        }
    }

    /// The layer this tensor belongs to, if any.
    pub const fn layer(&self) -> Option<u64> {
        if self.part.per_layer() {
            Some(self.layer)
        } else {
            None
        }
    }

    /// The routed expert this tensor belongs to, if any.
    pub const fn expert(&self) -> Option<u64> {
        if self.part.per_expert() {
            Some(self.expert)
        } else {
            None
        }
    }
}

/// How one family spells its parts in an HF checkpoint: `model.layers.{l}.{layer part}` and
/// `model.layers.{l}.{experts}.{e}.{expert part}`; the embedding, final norm and output
/// projection are the same in every family.
#[derive(Debug, PartialEq, Eq)]
pub struct HfNames {
    /// Each per-layer part's name below `model.layers.{l}.`.
    pub layer: &'static [(Part, &'static str)],
    /// The module of the routed experts below `model.layers.{l}.` (`mlp.experts`).
    pub experts: &'static str,
    /// Each per-expert part's name below `{experts}.{e}.`.
    pub expert: &'static [(Part, &'static str)],
}

/// The names outside the layers, shared by every family.
const GLOBAL: [(Part, &str); 3] = [
    (Part::Embed, "model.embed_tokens.weight"),
    (Part::LmHead, "lm_head.weight"),
    (Part::FinalNorm, "model.norm.weight"),
];

/// The HF names of Llama-shaped models (Llama, Qwen2, Qwen3, Qwen3-MoE).
pub const LLAMA_NAMES: HfNames = HfNames {
    layer: &[
        (Part::InputNorm, "input_layernorm.weight"),
        (Part::Q, "self_attn.q_proj.weight"),
        (Part::K, "self_attn.k_proj.weight"),
        (Part::V, "self_attn.v_proj.weight"),
        (Part::QBias, "self_attn.q_proj.bias"),
        (Part::KBias, "self_attn.k_proj.bias"),
        (Part::VBias, "self_attn.v_proj.bias"),
        (Part::O, "self_attn.o_proj.weight"),
        (Part::OBias, "self_attn.o_proj.bias"),
        (Part::QNorm, "self_attn.q_norm.weight"),
        (Part::KNorm, "self_attn.k_norm.weight"),
        (Part::PostNorm, "post_attention_layernorm.weight"),
        (Part::Gate, "mlp.gate_proj.weight"),
        (Part::Up, "mlp.up_proj.weight"),
        (Part::Down, "mlp.down_proj.weight"),
        (Part::Router, "mlp.gate.weight"),
    ],
    experts: "mlp.experts",
    expert: &[
        (Part::ExpertGate, "gate_proj.weight"),
        (Part::ExpertUp, "up_proj.weight"),
        (Part::ExpertDown, "down_proj.weight"),
    ],
};

/// Parses a decimal index written the way Python prints it (no sign, no leading zeros).
fn index(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) || (b.len() > 1 && b[0] == b'0') {
        return None;
    }
    s.parse().ok()
}

impl HfNames {
    /// The HF name of `c`; `None` when this family has no such part.
    pub fn name(&self, c: Canon) -> Option<String> {
        if let Some((_, n)) = GLOBAL.iter().find(|(p, _)| *p == c.part) {
            return Some((*n).to_string());
        }
        let l = c.layer;
        if c.part.per_expert() {
            let (_, leaf) = self.expert.iter().find(|(p, _)| *p == c.part)?;
            return Some(format!(
                "model.layers.{l}.{}.{}.{leaf}",
                self.experts, c.expert
            ));
        }
        let (_, leaf) = self.layer.iter().find(|(p, _)| *p == c.part)?;
        Some(format!("model.layers.{l}.{leaf}"))
    }

    /// Parses an HF name; `None` for names this family does not spell.
    pub fn parse(&self, name: &str) -> Option<Canon> {
        if let Some((p, _)) = GLOBAL.iter().find(|(_, n)| *n == name) {
            return Some(Canon::global(*p));
        }
        let (l, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
        let l = index(l)?;
        if let Some(expert) = rest
            .strip_prefix(self.experts)
            .and_then(|r| r.strip_prefix('.'))
        {
            if let Some((e, what)) = expert.split_once('.') {
                if let Some(e) = index(e) {
                    let (p, _) = self.expert.iter().find(|(_, n)| *n == what)?;
                    return Some(Canon::expert_at(*p, l, e));
                }
            }
        }
        let (p, _) = self.layer.iter().find(|(_, n)| *n == rest)?;
        Some(Canon::at(*p, l))
    }

    /// The module of a per-layer part below `model.layers.{l}.` (`self_attn` for `Q`), where an
    /// engine's fused tensor of the part's group lives; the experts module for per-expert parts.
    pub fn module(&self, part: Part) -> Option<&'static str> {
        if part.per_expert() {
            return Some(self.experts);
        }
        let (_, name) = self.layer.iter().find(|(p, _)| *p == part)?;
        // `{module}.{leaf}.{weight|bias}`
        let (module, _) = name.rsplit_once('.')?.0.rsplit_once('.')?;
        Some(module)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_names_round_trip_through_parse() {
        let n = &LLAMA_NAMES;
        let mut all = vec![
            Canon::global(Part::Embed),
            Canon::global(Part::LmHead),
            Canon::global(Part::FinalNorm),
        ];
        for (p, _) in n.layer {
            all.push(Canon::at(*p, 7));
        }
        for (p, _) in n.expert {
            all.push(Canon::expert_at(*p, 63, 383));
        }
        for c in all {
            let name = n.name(c).unwrap_or_default();
            assert_eq!(n.parse(&name), Some(c), "{name}");
        }
        assert_eq!(
            n.name(Canon::expert_at(Part::ExpertDown, 63, 383)),
            Some("model.layers.63.mlp.experts.383.down_proj.weight".to_string())
        );
        assert_eq!(n.name(Canon::at(Part::KvUp, 0)), None);
    }

    #[test]
    fn every_family_s_names_read_back_to_themselves() {
        // what `parse` accepts, `name` writes back unchanged: each spelling of a table names
        // one part, which no other spelling names (the FSDP layout gives a parsed name back
        // as the local name without writing it anew)
        for f in crate::model::family::ALL {
            let n = f.names;
            let mut spelled: Vec<String> = GLOBAL.iter().map(|(_, s)| s.to_string()).collect();
            spelled.extend(n.layer.iter().map(|(_, s)| format!("model.layers.12.{s}")));
            spelled.extend(
                n.expert
                    .iter()
                    .map(|(_, s)| format!("model.layers.3.{}.101.{s}", n.experts)),
            );
            for name in spelled {
                let Some(c) = n.parse(&name) else {
                    panic!("{}: `{name}` does not parse", f.name);
                };
                assert_eq!(n.name(c), Some(name.clone()), "{}", f.name);
            }
        }
    }

    #[test]
    fn parse_rejects_unknown_and_non_python_indices() {
        for bad in [
            "model.layers.01.input_layernorm.weight",
            "model.layers.+1.input_layernorm.weight",
            "model.layers.1.mlp.experts.x.up_proj.weight",
            "model.layers.1.self_attn.o_proj.scale",
            "model.embed_tokens",
            "",
        ] {
            assert_eq!(LLAMA_NAMES.parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_part_s_module_is_its_name_without_the_leaf() {
        assert_eq!(LLAMA_NAMES.module(Part::Q), Some("self_attn"));
        assert_eq!(LLAMA_NAMES.module(Part::Gate), Some("mlp"));
        assert_eq!(LLAMA_NAMES.module(Part::ExpertUp), Some("mlp.experts"));
        assert_eq!(LLAMA_NAMES.module(Part::InputNorm), None);
    }
}
