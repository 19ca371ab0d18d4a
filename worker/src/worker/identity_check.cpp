#include "worker/identity_check.h"

#include "common/fingerprint.h"
#include "version.h"

#include <nlohmann/json.hpp>

#include <sstream>

namespace dgr::worker {

namespace {

bool plan_has(const std::string & plan, const std::string & backend) {
    std::stringstream ss(plan);
    std::string item;
    while (std::getline(ss, item, '+')) {
        if (item == backend) return true;
    }
    return false;
}

}  // namespace

bool prove_identity(const std::string & model, const IdentityClaim & claim, ProvenIdentity * out, std::string * error,
                    const IdentityLog & log) {
    *out = ProvenIdentity{};
    if (!local_recipe_for(model, &out->recipe, error, log)) return false;
    const LocalRecipe & r = out->recipe;
    RecipeFingerprintFields f = r.fields;
    out->recipe_json = r.recipe_json;
    auto refuse = [&](const std::string & what, const std::string & claimed, const std::string & proven,
                      const std::string & source) {
        if (error) *error = what + " is '" + claimed + "', " + source + " gives '" + proven + "'";
        return false;
    };
    if (!claim.recipe_json.empty()) {
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(claim.recipe_json);
        } catch (const std::exception & e) {
            if (error) *error = std::string("--recipe-json is not JSON: ") + e.what();
            return false;
        }
        if (!j.is_object()) {
            if (error) *error = "--recipe-json must be a JSON object (dgr.gguf.recipe RuntimeRecipe.to_json())";
            return false;
        }
        RecipeFingerprintFields claimed = f;
        for (const auto & [name, proven] : f.named_values()) {
            if (!j.contains(name)) continue;
            const auto & v = j.at(name);
            std::string text;
            if (v.is_string()) {
                text = v.get<std::string>();
            } else if (v.is_number_unsigned()) {
                text = std::to_string(v.get<uint64_t>());
            } else {
                if (error) *error = "--recipe-json field " + name + " must be a string or a non-negative integer";
                return false;
            }
            if (!set_fingerprint_field(&claimed, name, text)) {
                if (error) *error = "--recipe-json field " + name + " '" + text + "' is not valid";
                return false;
            }
        }
        // every field but the backend plan is proven by the file or fixed by this build
        const auto want = f.named_values(), got = claimed.named_values();
        for (size_t i = 0; i < want.size(); ++i) {
            if (want[i].first == "backends") continue;
            if (got[i].second != want[i].second) {
                const bool from_file = want[i].first == "artifact_id" || want[i].first == "tokenizer_digest" ||
                                       want[i].first == "arch_adapter" || want[i].first == "arch_adapter_version";
                return refuse("--recipe-json " + want[i].first, got[i].second, want[i].second,
                              from_file ? "the model file" : "this worker build");
            }
        }
        if (j.contains("weight_types_digest") && j.at("weight_types_digest").is_string() &&
            j.at("weight_types_digest").get<std::string>() != r.identity.weight_types_digest) {
            return refuse("--recipe-json weight_types_digest", j.at("weight_types_digest").get<std::string>(),
                          r.identity.weight_types_digest, "the model file");
        }
        const std::string backend = build_info().backend;
        if (!plan_has(claimed.backends, backend)) {
            return refuse("--recipe-json backends (the route's plan)", claimed.backends, backend,
                          "this worker build (its backend must be part of the plan)");
        }
        f.backends = claimed.backends;
        out->recipe_json = claim.recipe_json;
    }
    std::string why;
    if (!recipe_fingerprint(f, &out->fingerprint, &why)) {
        if (error) *error = "cannot compute the recipe fingerprint: " + why;
        return false;
    }
    if (!claim.recipe_json.empty()) {
        const auto j = nlohmann::json::parse(claim.recipe_json);
        if (j.contains("fingerprint") && j.at("fingerprint").is_string() &&
            j.at("fingerprint").get<std::string>() != out->fingerprint) {
            return refuse("--recipe-json fingerprint", j.at("fingerprint").get<std::string>(), out->fingerprint,
                          "its own fields hashed (dgr-recipe-fingerprint/v2)");
        }
    }
    if (!claim.artifact_id.empty() && claim.artifact_id != r.identity.artifact_id) {
        return refuse("--artifact-id", claim.artifact_id, r.identity.artifact_id, "the model file");
    }
    if (!claim.fingerprint.empty() && claim.fingerprint != out->fingerprint) {
        return refuse("--fingerprint", claim.fingerprint, out->fingerprint,
                      "the model file with this build's recipe" +
                          std::string(claim.recipe_json.empty() ? " (pass --recipe-json for another backend plan)"
                                                                : " and the --recipe-json backend plan"));
    }
    return true;
}

}  // namespace dgr::worker
