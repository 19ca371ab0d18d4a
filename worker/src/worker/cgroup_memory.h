// The memory a worker may hold as its cgroup (v2) says: the smallest memory.max on the path from
// the worker's own cgroup (/proc/self/cgroup, the "0::" line) up to the root of the cgroup
// filesystem. Roots are parameters so that a test can point them at a fake /proc and /sys tree.
#pragma once

#include <cstdint>
#include <string>

namespace dgr::worker {

struct CgroupLimit {
    bool limited = false;   // false: no memory.max on the path (or "max" everywhere, or no cgroup v2)
    uint64_t bytes = 0;     // the smallest limit found
    std::string file;       // the memory.max file that holds it
};

// proc_self_cgroup: normally /proc/self/cgroup; cgroup_root: normally /sys/fs/cgroup.
CgroupLimit cgroup_memory_limit(const std::string & proc_self_cgroup = "/proc/self/cgroup",
                                const std::string & cgroup_root = "/sys/fs/cgroup");

}  // namespace dgr::worker
