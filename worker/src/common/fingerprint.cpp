#include "common/fingerprint.h"

#include "common/sha256.h"

namespace dgr {
namespace {

bool canonical_char(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == ':' || c == '/' || c == '+' || c == '-';
}

bool check_value(const std::string & name, const std::string & v, std::string * error) {
    if (v.empty() || v.size() > 128) {
        if (error) *error = "recipe field " + name + " must be 1-128 characters";
        return false;
    }
    for (char c : v) {
        if (!canonical_char(c)) {
            if (error) *error = "recipe field " + name + " has a character outside [A-Za-z0-9._:/+-]";
            return false;
        }
    }
    return true;
}

bool parse_nonneg(const std::string & s, int64_t * out) {
    if (s.empty() || s.size() > 18) return false;
    int64_t v = 0;
    for (char c : s) {
        if (c < '0' || c > '9') return false;
        v = v * 10 + (c - '0');
    }
    *out = v;
    return true;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> RecipeFingerprintFields::named_values() const {
    return {
        {"activation_dtype", activation_dtype},
        {"arch_adapter", arch_adapter},
        {"arch_adapter_version", std::to_string(arch_adapter_version)},
        {"artifact_id", artifact_id},
        {"backends", backends},
        {"boundary_schema_version", std::to_string(boundary_schema_version)},
        {"kv_dtype", kv_dtype},
        {"kv_layout", kv_layout},
        {"patch_digest", patch_digest},
        {"pin_commit", pin_commit},
        {"tokenizer_digest", tokenizer_digest},
    };
}

bool recipe_canonical_text(const RecipeFingerprintFields & f, std::string * out, std::string * error) {
    if (f.arch_adapter_version < 0 || f.boundary_schema_version < 0) {
        if (error) *error = "recipe versions must not be negative";
        return false;
    }
    std::string text = std::string(kFingerprintHeader) + "\n";
    for (const auto & [name, value] : f.named_values()) {
        if (!check_value(name, value, error)) return false;
        text += name;
        text += '=';
        text += value;
        text += '\n';
    }
    *out = std::move(text);
    return true;
}

bool recipe_fingerprint(const RecipeFingerprintFields & f, std::string * out, std::string * error) {
    std::string text;
    if (!recipe_canonical_text(f, &text, error)) return false;
    *out = sha256_hex(text);
    return true;
}

bool set_fingerprint_field(RecipeFingerprintFields * f, const std::string & name, const std::string & value) {
    if (name == "activation_dtype") f->activation_dtype = value;
    else if (name == "arch_adapter") f->arch_adapter = value;
    else if (name == "arch_adapter_version") return parse_nonneg(value, &f->arch_adapter_version);
    else if (name == "artifact_id") f->artifact_id = value;
    else if (name == "backends") f->backends = value;
    else if (name == "boundary_schema_version") return parse_nonneg(value, &f->boundary_schema_version);
    else if (name == "kv_dtype") f->kv_dtype = value;
    else if (name == "kv_layout") f->kv_layout = value;
    else if (name == "patch_digest") f->patch_digest = value;
    else if (name == "pin_commit") f->pin_commit = value;
    else if (name == "tokenizer_digest") f->tokenizer_digest = value;
    else return false;
    return true;
}

}  // namespace dgr
