#include "worker/cgroup_memory.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace dgr::worker {

namespace {

// memory.max holds "max" or a byte count; false when unreadable or "max"
bool read_limit(const std::string & file, uint64_t * out) {
    std::ifstream f(file);
    std::string v;
    if (!f || !(f >> v) || v == "max") return false;
    char * end = nullptr;
    errno = 0;
    const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
    if (errno || !end || *end || v[0] == '-') return false;
    *out = n;
    return true;
}

}  // namespace

CgroupLimit cgroup_memory_limit(const std::string & proc_self_cgroup, const std::string & cgroup_root) {
    CgroupLimit lim;
    std::ifstream f(proc_self_cgroup);
    std::string line, rel;
    bool found = false;
    while (std::getline(f, line)) {
        if (line.rfind("0::", 0) == 0) {  // the cgroup v2 (unified) hierarchy
            rel = line.substr(3);
            found = true;
            break;
        }
    }
    if (!found) return lim;
    // a path outside this cgroup namespace shows as "/../x": only its own part can be read
    while (rel.rfind("/..", 0) == 0) rel = rel.substr(3);
    std::string path = rel;
    while (!path.empty() && path.back() == '/') path.pop_back();
    for (;;) {
        const std::string file = cgroup_root + path + "/memory.max";
        uint64_t v = 0;
        if (read_limit(file, &v) && (!lim.limited || v < lim.bytes)) {
            lim.limited = true;
            lim.bytes = v;
            lim.file = file;
        }
        if (path.empty()) break;
        const size_t slash = path.rfind('/');
        path = slash == std::string::npos ? std::string() : path.substr(0, slash);
    }
    return lim;
}

}  // namespace dgr::worker
