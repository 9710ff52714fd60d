//! Canonical (HF checkpoint) tensor names as values: what every backend's layout parses and
//! spells, in one place.

/// A canonical (HF checkpoint) tensor, identified without its string name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Canon {
    /// `model.embed_tokens.weight`
    Embed,
    /// `lm_head.weight`
    LmHead,
    /// `model.norm.weight`
    FinalNorm,
    /// `model.layers.{l}.input_layernorm.weight`
    InputNorm(u64),
    /// `model.layers.{l}.self_attn.q_proj.weight`
    Q(u64),
    /// `model.layers.{l}.self_attn.k_proj.weight`
    K(u64),
    /// `model.layers.{l}.self_attn.v_proj.weight`
    V(u64),
    /// `model.layers.{l}.self_attn.q_proj.bias`
    QBias(u64),
    /// `model.layers.{l}.self_attn.k_proj.bias`
    KBias(u64),
    /// `model.layers.{l}.self_attn.v_proj.bias`
    VBias(u64),
    /// `model.layers.{l}.self_attn.o_proj.weight`
    O(u64),
    /// `model.layers.{l}.self_attn.q_norm.weight`
    QNorm(u64),
    /// `model.layers.{l}.self_attn.k_norm.weight`
    KNorm(u64),
    /// `model.layers.{l}.post_attention_layernorm.weight`
    PostNorm(u64),
    /// `model.layers.{l}.mlp.gate_proj.weight`
    Gate(u64),
    /// `model.layers.{l}.mlp.up_proj.weight`
    Up(u64),
    /// `model.layers.{l}.mlp.down_proj.weight`
    Down(u64),
    /// `model.layers.{l}.mlp.gate.weight` (the MoE router)
    Router(u64),
    /// `model.layers.{l}.mlp.experts.{e}.gate_proj.weight`
    ExpertGate(u64, u64),
    /// `model.layers.{l}.mlp.experts.{e}.up_proj.weight`
    ExpertUp(u64, u64),
    /// `model.layers.{l}.mlp.experts.{e}.down_proj.weight`
    ExpertDown(u64, u64),
}

/// Parses a decimal index written the way Python prints it (no sign, no leading zeros).
fn index(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) || (b.len() > 1 && b[0] == b'0') {
        return None;
    }
    s.parse().ok()
}

/// A layer's tensor, given its layer.
type LayerTensor = fn(u64) -> Canon;
/// An expert's tensor, given its layer and expert.
type ExpertTensor = fn(u64, u64) -> Canon;

/// The tensors of a layer outside its experts: the name after `model.layers.{l}.`.
const LAYER_TENSORS: [(&str, LayerTensor); 15] = [
    ("input_layernorm.weight", Canon::InputNorm),
    ("self_attn.q_proj.weight", Canon::Q),
    ("self_attn.k_proj.weight", Canon::K),
    ("self_attn.v_proj.weight", Canon::V),
    ("self_attn.q_proj.bias", Canon::QBias),
    ("self_attn.k_proj.bias", Canon::KBias),
    ("self_attn.v_proj.bias", Canon::VBias),
    ("self_attn.o_proj.weight", Canon::O),
    ("self_attn.q_norm.weight", Canon::QNorm),
    ("self_attn.k_norm.weight", Canon::KNorm),
    ("post_attention_layernorm.weight", Canon::PostNorm),
    ("mlp.gate_proj.weight", Canon::Gate),
    ("mlp.up_proj.weight", Canon::Up),
    ("mlp.down_proj.weight", Canon::Down),
    ("mlp.gate.weight", Canon::Router),
];

/// An expert's tensors: the name after `model.layers.{l}.mlp.experts.{e}.`.
const EXPERT_TENSORS: [(&str, ExpertTensor); 3] = [
    ("gate_proj.weight", Canon::ExpertGate),
    ("up_proj.weight", Canon::ExpertUp),
    ("down_proj.weight", Canon::ExpertDown),
];

impl Canon {
    /// The HF name.
    pub fn name(&self) -> String {
        let same = |c: Canon| std::mem::discriminant(&c) == std::mem::discriminant(self);
        match *self {
            Canon::Embed => "model.embed_tokens.weight".into(),
            Canon::LmHead => "lm_head.weight".into(),
            Canon::FinalNorm => "model.norm.weight".into(),
            Canon::ExpertGate(l, e) | Canon::ExpertUp(l, e) | Canon::ExpertDown(l, e) => {
                let (what, _) = EXPERT_TENSORS
                    .iter()
                    .find(|(_, mk)| same(mk(0, 0)))
                    .expect("every expert tensor is in EXPERT_TENSORS");
                format!("model.layers.{l}.mlp.experts.{e}.{what}")
            }
            _ => {
                let l = self.layer().expect("every other tensor is a layer's");
                let (what, _) = LAYER_TENSORS
                    .iter()
                    .find(|(_, mk)| same(mk(0)))
                    .expect("every layer tensor is in LAYER_TENSORS");
                format!("model.layers.{l}.{what}")
            }
        }
    }

    /// Parses an HF name; `None` for names no supported model has.
    pub fn parse(name: &str) -> Option<Canon> {
        match name {
            "model.embed_tokens.weight" => return Some(Canon::Embed),
            "lm_head.weight" => return Some(Canon::LmHead),
            "model.norm.weight" => return Some(Canon::FinalNorm),
            _ => {}
        }
        let (l, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
        let l = index(l)?;
        if let Some(expert) = rest.strip_prefix("mlp.experts.") {
            let (e, what) = expert.split_once('.')?;
            let e = index(e)?;
            let (_, mk) = EXPERT_TENSORS.iter().find(|(n, _)| *n == what)?;
            return Some(mk(l, e));
        }
        let (_, mk) = LAYER_TENSORS.iter().find(|(n, _)| *n == rest)?;
        Some(mk(l))
    }

    /// The layer this tensor belongs to, if any.
    pub fn layer(&self) -> Option<u64> {
        match *self {
            Canon::Embed | Canon::LmHead | Canon::FinalNorm => None,
            Canon::ExpertGate(l, _) | Canon::ExpertUp(l, _) | Canon::ExpertDown(l, _) => Some(l),
            Canon::InputNorm(l)
            | Canon::Q(l)
            | Canon::K(l)
            | Canon::V(l)
            | Canon::QBias(l)
            | Canon::KBias(l)
            | Canon::VBias(l)
            | Canon::O(l)
            | Canon::QNorm(l)
            | Canon::KNorm(l)
            | Canon::PostNorm(l)
            | Canon::Gate(l)
            | Canon::Up(l)
            | Canon::Down(l)
            | Canon::Router(l) => Some(l),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_names_round_trip_through_parse() {
        let all = [
            Canon::Embed,
            Canon::LmHead,
            Canon::FinalNorm,
            Canon::InputNorm(3),
            Canon::Q(10),
            Canon::K(0),
            Canon::V(1),
            Canon::QBias(2),
            Canon::KBias(2),
            Canon::VBias(2),
            Canon::O(7),
            Canon::QNorm(7),
            Canon::KNorm(7),
            Canon::PostNorm(7),
            Canon::Gate(1),
            Canon::Up(1),
            Canon::Down(1),
            Canon::Router(5),
            Canon::ExpertGate(5, 127),
            Canon::ExpertUp(5, 0),
            Canon::ExpertDown(63, 383),
        ];
        for c in all {
            assert_eq!(Canon::parse(&c.name()), Some(c), "{}", c.name());
        }
        assert_eq!(
            Canon::ExpertDown(63, 383).name(),
            "model.layers.63.mlp.experts.383.down_proj.weight"
        );
    }

    #[test]
    fn parse_rejects_unknown_and_non_python_indices() {
        for bad in [
            "model.layers.01.input_layernorm.weight",
            "model.layers.+1.input_layernorm.weight",
            "model.layers.1.mlp.experts.x.up_proj.weight",
            "model.layers.1.self_attn.o_proj.bias",
            "model.embed_tokens",
            "",
        ] {
            assert_eq!(Canon::parse(bad), None, "{bad}");
        }
    }
}
