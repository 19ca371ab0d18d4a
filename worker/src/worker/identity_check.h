// Identity proven by the file (docs/identity.md, docs/worker.md "Identity"): the worker computes
// the artifact id, tokenizer digest and recipe fingerprint from what it loads (a slice is
// verified against the manifest it carries first, common/slice_verify.h). The flags
// --artifact-id, --fingerprint and --recipe-json may only name what is expected: each proven
// field they state must equal the file's (or this build's) value, else the worker refuses to
// start, printing both values. What --recipe-json may choose is what the file cannot say: the
// route's backend plan (`backends`, which must include this build's backend).
#pragma once

#include "common/identity.h"

#include <string>

namespace dgr::worker {

struct IdentityClaim {
    std::string fingerprint, artifact_id, recipe_json;  // empty: not stated
};

struct ProvenIdentity {
    LocalRecipe recipe;        // from the file and this build
    std::string fingerprint;   // served (the recipe's, with the claimed backend plan)
    std::string recipe_json;   // served (the claim's when given, else the computed one)
};

// false + *error (one line naming the flag and both values) when the file cannot be read or
// verified or a claim disagrees with it.
bool prove_identity(const std::string & model, const IdentityClaim & claim, ProvenIdentity * out, std::string * error,
                    const IdentityLog & log = nullptr);

}  // namespace dgr::worker
