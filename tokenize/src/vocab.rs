//! The vocabularies: Hugging Face `tokenizers`, and tiktoken-format ranks (files, builtins and
//! Mistral's tekken JSON) through `tiktoken-rs`. Loading validates what the libraries would
//! otherwise assert on; counting catches a library panic and reports it as an error.

use std::collections::{HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use base64::Engine as _;
use serde::Deserialize;
use tiktoken_rs::{CoreBPE, Rank};
use unicode_normalization::{is_nfc_quick, IsNormalized, UnicodeNormalization};

use crate::spec::{spec_error, Normalization, SpecError, TiktokenSpec, TokenizerSpec};
use crate::TokenizeError;

/// The map type `tiktoken-rs` takes.
type FxMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// A loaded vocabulary.
pub(crate) enum Vocabulary {
    HuggingFace(Box<tokenizers::Tokenizer>),
    Tiktoken(Box<TiktokenVocab>),
}

pub(crate) struct TiktokenVocab {
    bpe: CoreBPE,
    has_specials: bool,
    /// Whether special tokens written in a completions prompt are recognized (tiktoken
    /// vocabularies, like Hugging Face added tokens) or plain text (Mistral's `Tekkenizer.encode`,
    /// which vLLM's Mistral tokenizer uses for prompts).
    specials_in_prompts: bool,
    nfc: bool,
    add_bos: bool,
    max_token_bytes: Option<usize>,
}

impl Vocabulary {
    pub(crate) fn load(spec: &TokenizerSpec) -> Result<Self, SpecError> {
        spec.validate()?;
        if let Some(path) = &spec.huggingface {
            return load_huggingface(path);
        }
        if let Some(t) = &spec.tiktoken {
            return load_tiktoken(t);
        }
        if let Some(path) = &spec.tekken {
            return load_tekken(path);
        }
        Err(spec_error("tokenizer", "no vocabulary configured"))
    }

    /// Tokens of text that is already the model's input (a rendered chat template): special
    /// tokens written in it are recognized, nothing is added.
    pub(crate) fn count_rendered(&self, text: &str) -> Result<usize, TokenizeError> {
        match self {
            Vocabulary::HuggingFace(t) => hf_count(t, text, false),
            Vocabulary::Tiktoken(t) => t.count(text, true),
        }
    }

    /// Tokens of a completions prompt: as [`Vocabulary::count_rendered`] plus what the tokenizer
    /// adds with `add_special_tokens` (BOS for Llama/Mistral-style tokenizers).
    pub(crate) fn count_prompt(&self, text: &str) -> Result<usize, TokenizeError> {
        match self {
            Vocabulary::HuggingFace(t) => hf_count(t, text, true),
            Vocabulary::Tiktoken(t) => Ok(t.count(text, t.specials_in_prompts)? + usize::from(t.add_bos)),
        }
    }

    pub(crate) fn max_token_bytes(&self) -> Option<usize> {
        match self {
            Vocabulary::HuggingFace(t) => hf_max_token_bytes(t),
            Vocabulary::Tiktoken(t) => t.max_token_bytes,
        }
    }
}

fn guard<T>(f: impl FnOnce() -> Result<T, TokenizeError>) -> Result<T, TokenizeError> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(TokenizeError::Tokenizer("the tokenizer panicked".into())))
}

fn hf_count(t: &tokenizers::Tokenizer, text: &str, add_special_tokens: bool) -> Result<usize, TokenizeError> {
    guard(|| {
        t.encode_fast(text, add_special_tokens)
            .map(|e| e.len())
            .map_err(|e| TokenizeError::Tokenizer(e.to_string()))
    })
}

impl TiktokenVocab {
    fn count(&self, text: &str, specials: bool) -> Result<usize, TokenizeError> {
        let normalized;
        let text = if self.nfc && is_nfc_quick(text.chars()) != IsNormalized::Yes {
            normalized = text.nfc().collect::<String>();
            normalized.as_str()
        } else {
            text
        };
        guard(|| {
            Ok(if specials && self.has_specials {
                self.bpe.encode_with_special_tokens(text).len()
            } else {
                self.bpe.encode_ordinary(text).len()
            })
        })
    }
}

fn load_huggingface(path: &Path) -> Result<Vocabulary, SpecError> {
    let field = "tokenizer.huggingface";
    let mut t = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| spec_error(field, format!("{}: {e}", path.display())))?;
    // transformers (and so vLLM) never truncates or pads a single prompt by default.
    t.with_truncation(None).map_err(|e| spec_error(field, format!("{}: {e}", path.display())))?;
    t.with_padding(None);
    Ok(Vocabulary::HuggingFace(Box::new(t)))
}

/// GPT-2's byte-to-unicode table, inverted: the byte each ByteLevel vocabulary character stands
/// for.
fn byte_level_inverse() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~')).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut out = HashMap::new();
    let mut extra = 0u32;
    for b in 0u32..=255 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        if let (Some(c), Ok(byte)) = (char::from_u32(c), u8::try_from(b)) {
            out.insert(c, byte);
        }
    }
    out
}

fn hf_max_token_bytes(t: &tokenizers::Tokenizer) -> Option<usize> {
    let inverse = byte_level_inverse();
    let added: HashSet<String> = t.get_added_tokens_decoder().values().map(|a| a.content.clone()).collect();
    let mut max = 0;
    for token in t.get_vocab(true).keys() {
        let bytes = if added.contains(token) {
            token.len()
        } else if token.chars().all(|c| inverse.contains_key(&c)) {
            token.chars().count()
        } else {
            // Not a ByteLevel vocabulary (e.g. SentencePiece `▁`): no exact byte length.
            return None;
        };
        max = max.max(bytes);
    }
    Some(max)
}

fn load_tiktoken(spec: &TiktokenSpec) -> Result<Vocabulary, SpecError> {
    let (bpe, has_specials, max_token_bytes) = match spec.ranks.as_str() {
        "cl100k_base" => (
            tiktoken_rs::cl100k_base().map_err(|e| spec_error("tokenizer.tiktoken.ranks", e.to_string()))?,
            true,
            None,
        ),
        "o200k_base" => (
            tiktoken_rs::o200k_base().map_err(|e| spec_error("tokenizer.tiktoken.ranks", e.to_string()))?,
            true,
            None,
        ),
        path => {
            let field = "tokenizer.tiktoken.ranks";
            let text =
                std::fs::read_to_string(path).map_err(|e| spec_error(field, format!("{path}: {e}")))?;
            let ranks = parse_tiktoken_ranks(&text).map_err(|m| spec_error(field, format!("{path}: {m}")))?;
            let pattern = spec.pattern.as_deref().unwrap_or_default();
            let max = max_bytes(&ranks, &spec.special_tokens);
            let bpe = build_bpe(ranks, &spec.special_tokens, pattern, "tokenizer.tiktoken")?;
            (bpe, !spec.special_tokens.is_empty(), Some(max))
        }
    };
    Ok(Vocabulary::Tiktoken(Box::new(TiktokenVocab {
        bpe,
        has_specials,
        specials_in_prompts: true,
        nfc: spec.normalization == Normalization::Nfc,
        add_bos: spec.add_bos,
        max_token_bytes,
    })))
}

fn max_bytes(ranks: &FxMap<Vec<u8>, Rank>, specials: &[String]) -> usize {
    ranks.keys().map(Vec::len).chain(specials.iter().map(String::len)).max().unwrap_or(0)
}

/// Parses `<base64> <rank>` lines; ranks must be unique.
fn parse_tiktoken_ranks(text: &str) -> Result<FxMap<Vec<u8>, Rank>, String> {
    let mut ranks: FxMap<Vec<u8>, Rank> = FxMap::default();
    let mut seen: HashSet<Rank> = HashSet::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(token), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!("line {}: expected `<base64 token> <rank>`", i + 1));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| format!("line {}: {e}", i + 1))?;
        let rank: Rank = rank.parse().map_err(|e| format!("line {}: rank: {e}", i + 1))?;
        if !seen.insert(rank) {
            return Err(format!("line {}: duplicate rank {rank}", i + 1));
        }
        if ranks.insert(bytes, rank).is_some() {
            return Err(format!("line {}: duplicate token", i + 1));
        }
    }
    if ranks.is_empty() {
        return Err("no ranks".into());
    }
    Ok(ranks)
}

/// `CoreBPE::new` panics on duplicate ranks; the callers have checked there are none. Special
/// tokens get the ids after the largest rank.
fn build_bpe(
    ranks: FxMap<Vec<u8>, Rank>,
    specials: &[String],
    pattern: &str,
    field: &str,
) -> Result<CoreBPE, SpecError> {
    let next = ranks.values().copied().max().unwrap_or(0).saturating_add(1);
    let mut special_map: FxMap<String, Rank> = FxMap::default();
    for (i, s) in specials.iter().enumerate() {
        let id = u32::try_from(i)
            .ok()
            .and_then(|i| next.checked_add(i))
            .ok_or_else(|| spec_error(field, "too many special tokens"))?;
        special_map.insert(s.clone(), id);
    }
    // `CoreBPE::new` builds its special-token regex from the map; with no special token at all
    // it would match the empty string, so an unused placeholder keeps it well-formed (counting
    // then uses `encode_ordinary`).
    if special_map.is_empty() {
        special_map.insert("<|gateway-no-special-token|>".into(), next);
    }
    catch_unwind(AssertUnwindSafe(|| CoreBPE::new(ranks, special_map, pattern)))
        .map_err(|_| spec_error(field, "the vocabulary could not be built"))?
        .map_err(|e| spec_error(format!("{field}.pattern"), e.to_string()))
}

/// The parts of Mistral's `tekken.json` that tokenizing needs (other members are ignored: it is a
/// foreign format that grows).
#[derive(Deserialize)]
struct TekkenFile {
    config: TekkenConfig,
    vocab: Vec<TekkenToken>,
    #[serde(default)]
    special_tokens: Option<Vec<TekkenSpecial>>,
}

#[derive(Deserialize)]
struct TekkenConfig {
    pattern: String,
    default_vocab_size: usize,
    default_num_special_tokens: usize,
}

#[derive(Deserialize)]
struct TekkenToken {
    rank: Rank,
    token_bytes: String,
}

#[derive(Deserialize)]
struct TekkenSpecial {
    token_str: String,
}

/// `mistral_common`'s `Tekkenizer.DEPRECATED_SPECIAL_TOKENS`: the special tokens of tekken files
/// that do not list their own (versions up to v7).
const TEKKEN_DEPRECATED_SPECIALS: [&str; 20] = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
];

/// Loads a tekken file as `mistral_common`'s `Tekkenizer.from_file` does: the first
/// `default_vocab_size - default_num_special_tokens` ranks, the listed (or deprecated) special
/// tokens padded with `<SPECIAL_{i}>` fillers up to `default_num_special_tokens`.
fn load_tekken(path: &Path) -> Result<Vocabulary, SpecError> {
    let field = "tokenizer.tekken";
    let at = |m: String| spec_error(field, format!("{}: {m}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
    let file: TekkenFile = serde_json::from_str(&text).map_err(|e| at(e.to_string()))?;
    let num_special = file.config.default_num_special_tokens;
    let inner = file
        .config
        .default_vocab_size
        .checked_sub(num_special)
        .filter(|n| *n <= file.vocab.len())
        .ok_or_else(|| at("default_vocab_size does not fit the vocabulary".into()))?;
    let mut ranks: FxMap<Vec<u8>, Rank> = FxMap::default();
    for (i, t) in file.vocab.iter().take(inner).enumerate() {
        if usize::try_from(t.rank).ok() != Some(i) {
            return Err(at(format!("vocab[{i}].rank: expected {i}")));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&t.token_bytes)
            .map_err(|e| at(format!("vocab[{i}].token_bytes: {e}")))?;
        if ranks.insert(bytes, t.rank).is_some() {
            return Err(at(format!("vocab[{i}]: duplicate token")));
        }
    }
    let mut specials: Vec<String> = match &file.special_tokens {
        Some(list) => list.iter().map(|s| s.token_str.clone()).collect(),
        None => TEKKEN_DEPRECATED_SPECIALS.iter().map(|s| (*s).to_string()).collect(),
    };
    if specials.len() > num_special {
        return Err(at("more special tokens than default_num_special_tokens".into()));
    }
    for i in specials.len()..num_special {
        specials.push(format!("<SPECIAL_{i}>"));
    }
    let unique: HashSet<&String> = specials.iter().collect();
    if unique.len() != specials.len() || specials.iter().any(String::is_empty) {
        return Err(at("special tokens must be unique and non-empty".into()));
    }
    let max = max_bytes(&ranks, &specials);
    let bpe = build_bpe(ranks, &specials, &file.config.pattern, field)?;
    Ok(Vocabulary::Tiktoken(Box::new(TiktokenVocab {
        bpe,
        has_specials: !specials.is_empty(),
        specials_in_prompts: false,
        nfc: false,
        add_bos: true,
        max_token_bytes: Some(max),
    })))
}
