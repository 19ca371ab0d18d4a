// The memory a worker may hold as its cgroup says: the smallest limit on the path from the
// worker's own cgroup up to the root of the hierarchy. cgroup v2: memory.max along the "0::" path
// of /proc/self/cgroup. cgroup v1 (and hybrid machines): memory.limit_in_bytes along the path of
// the line whose controllers include "memory", under <root>/memory. Roots are parameters so that a
// test can point them at a fake /proc and /sys tree.
#pragma once

#include <cstdint>
#include <string>

namespace dgr::worker {

struct CgroupLimit {
    bool limited = false;   // false: no limit on either path ("max", or v1's huge "unlimited")
    uint64_t bytes = 0;     // the smallest limit found
    std::string file;       // the memory.max or memory.limit_in_bytes file that holds it
};

// proc_self_cgroup: normally /proc/self/cgroup; cgroup_root: normally /sys/fs/cgroup.
CgroupLimit cgroup_memory_limit(const std::string & proc_self_cgroup = "/proc/self/cgroup",
                                const std::string & cgroup_root = "/sys/fs/cgroup");

}  // namespace dgr::worker
