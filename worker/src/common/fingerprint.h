// Recipe compatibility fingerprint: the same value as dgr.recipe.RuntimeRecipe.fingerprint()
// (docs/identity.md). The canonical text is
//   "dgr-recipe-fingerprint/v2\n" + "name=value\n" for each field below, in this order,
// and the fingerprint is its SHA-256 in lowercase hex. Values are 1-128 characters of
// [A-Za-z0-9._:/+-]; anything else is refused (never silently normalised).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dgr {

inline constexpr const char * kFingerprintHeader = "dgr-recipe-fingerprint/v2";

struct RecipeFingerprintFields {
    std::string activation_dtype;      // on the wire, at a seam (e.g. "f32")
    std::string arch_adapter;          // e.g. "llama"
    int64_t arch_adapter_version = 0;
    std::string artifact_id;           // sha256 hex of the source artifact manifest
    std::string backends;              // the route's backend plan, e.g. "cpu", "cpu+vulkan"
    int64_t boundary_schema_version = 0;
    std::string kv_dtype;              // e.g. "f16"
    std::string kv_layout;             // e.g. "llama-unified-layer-filtered"
    std::string patch_digest;          // patch-series digest
    std::string pin_commit;            // llama.cpp pin commit
    std::string tokenizer_digest;      // sha256 hex over the tokenizer.* metadata

    // (name, canonical value) in canonical order.
    std::vector<std::pair<std::string, std::string>> named_values() const;
};

// Fill *out with the canonical text; on a non-canonical value return false and say why in *error.
bool recipe_canonical_text(const RecipeFingerprintFields & f, std::string * out, std::string * error);

// Fill *out with the fingerprint (sha256 hex of the canonical text); false + *error as above.
bool recipe_fingerprint(const RecipeFingerprintFields & f, std::string * out, std::string * error);

// Set one field by its canonical name from text (for vectors and handshakes); false if the
// name is unknown or an integer field is not a non-negative decimal.
bool set_fingerprint_field(RecipeFingerprintFields * f, const std::string & name, const std::string & value);

}  // namespace dgr
