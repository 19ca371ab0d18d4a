// Build identity of this dgr-worker binary (set by `dgr build` at configure time).
#pragma once

namespace dgr {

struct BuildInfo {
    const char * dgr_version;
    const char * pin_commit;
    const char * patch_digest;
    const char * backend;
};

const BuildInfo & build_info();

}  // namespace dgr
