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

// Walks from cgroup_root + rel up to cgroup_root, keeping the smallest limit in file_name.
void walk(const std::string & cgroup_root, std::string rel, const char * file_name, CgroupLimit * lim) {
    // a path outside this cgroup namespace shows as "/../x": only its own part can be read
    while (rel.rfind("/..", 0) == 0) rel = rel.substr(3);
    std::string path = rel;
    while (!path.empty() && path.back() == '/') path.pop_back();
    for (;;) {
        const std::string file = cgroup_root + path + "/" + file_name;
        uint64_t v = 0;
        // cgroup v1 writes "no limit" as a page-rounded LONG_MAX: anything that large is none
        if (read_limit(file, &v) && v < (1ull << 62) && (!lim->limited || v < lim->bytes)) {
            lim->limited = true;
            lim->bytes = v;
            lim->file = file;
        }
        if (path.empty()) break;
        const size_t slash = path.rfind('/');
        path = slash == std::string::npos ? std::string() : path.substr(0, slash);
    }
}

bool has_controller(const std::string & list, const std::string & name) {
    std::stringstream ss(list);
    std::string c;
    while (std::getline(ss, c, ',')) {
        if (c == name) return true;
    }
    return false;
}

}  // namespace

CgroupLimit cgroup_memory_limit(const std::string & proc_self_cgroup, const std::string & cgroup_root) {
    CgroupLimit lim;
    std::ifstream f(proc_self_cgroup);
    std::string line;
    while (std::getline(f, line)) {
        // "<id>:<controllers>:<path>"; the unified (v2) hierarchy is "0::<path>"
        const size_t a = line.find(':');
        const size_t b = a == std::string::npos ? std::string::npos : line.find(':', a + 1);
        if (b == std::string::npos) continue;
        const std::string controllers = line.substr(a + 1, b - a - 1);
        const std::string rel = line.substr(b + 1);
        if (line.rfind("0::", 0) == 0) {
            walk(cgroup_root, rel, "memory.max", &lim);
        } else if (has_controller(controllers, "memory")) {
            // cgroup v1: the memory hierarchy is mounted as <root>/memory (or as its
            // controller list when several share one hierarchy)
            std::string mount = cgroup_root + "/" + controllers;
            if (std::ifstream(mount + "/memory.limit_in_bytes").fail()) mount = cgroup_root + "/memory";
            walk(mount, rel, "memory.limit_in_bytes", &lim);
        }
    }
    return lim;
}

}  // namespace dgr::worker
