#include "version.h"

namespace dgr {

const BuildInfo & build_info() {
    static const BuildInfo info{DGR_VERSION, DGR_PIN_COMMIT, DGR_PATCH_DIGEST, DGR_BACKEND};
    return info;
}

}  // namespace dgr
