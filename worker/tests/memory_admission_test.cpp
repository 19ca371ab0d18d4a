// Memory-true admission without a model (worker/cgroup_memory.h, worker/memory_plan.h): the
// cgroup memory walk (v2 memory.max, v1 memory.limit_in_bytes) over a fake /proc and /sys tree, the budget (the smaller of the flag
// and the cgroup), and the refusal line with what would fit.
#include "worker/cgroup_memory.h"
#include "worker/memory_plan.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "check.h"

using namespace dgr::worker;
namespace fs = std::filesystem;

static void put(const fs::path & p, const std::string & text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
}

int main() {
    char tmpl[] = "/tmp/dgr-cgroup-XXXXXX";
    const fs::path root = mkdtemp(tmpl);
    const fs::path proc = root / "proc_self_cgroup", sys = root / "sys";
    // a v1 line whose files are absent adds nothing; the unified line names /lab/h1/worker
    put(proc, "12:memory:/ignored\n0::/lab/h1/worker\n");
    put(sys / "memory.max", "max\n");
    put(sys / "lab/memory.max", "1073741824\n");
    put(sys / "lab/h1/memory.max", "243269632\n");  // 232 MiB: the smallest on the path
    put(sys / "lab/h1/worker/memory.max", "max\n");
    CgroupLimit lim = cgroup_memory_limit(proc.string(), sys.string());
    CHECK(lim.limited && lim.bytes == 243269632ull, "smallest on the path: %llu", (unsigned long long) lim.bytes);
    CHECK(lim.file == (sys / "lab/h1/memory.max").string(), "file %s", lim.file.c_str());

    // a limit below the worker's own group wins too
    put(sys / "lab/h1/worker/memory.max", "104857600\n");
    lim = cgroup_memory_limit(proc.string(), sys.string());
    CHECK(lim.bytes == 104857600ull && lim.file == (sys / "lab/h1/worker/memory.max").string(), "own group");

    // no limit anywhere, no v2 line, an unreadable value
    put(proc, "0::/free\n");
    put(sys / "free/memory.max", "max\n");
    CHECK(!cgroup_memory_limit(proc.string(), sys.string()).limited, "max everywhere");
    // cgroup v1 (or hybrid): memory.limit_in_bytes under <root>/memory; v1's "unlimited" is none
    put(proc, "12:memory:/x\n");
    CHECK(!cgroup_memory_limit(proc.string(), sys.string()).limited, "cgroup v1, no files");
    put(sys / "memory/memory.limit_in_bytes", "9223372036854771712\n");
    put(sys / "memory/x/memory.limit_in_bytes", "9223372036854771712\n");
    CHECK(!cgroup_memory_limit(proc.string(), sys.string()).limited, "cgroup v1 unlimited");
    put(sys / "memory/x/memory.limit_in_bytes", "188743680\n");
    lim = cgroup_memory_limit(proc.string(), sys.string());
    CHECK(lim.limited && lim.bytes == 188743680ull && lim.file == (sys / "memory/x/memory.limit_in_bytes").string(),
          "cgroup v1 limit: %s", lim.file.c_str());
    // hybrid: a v1 memory line and a v2 line without memory.max; the v1 limit holds
    put(proc, "7:cpu,cpuacct:/\n4:memory:/x\n0::/\n");
    CHECK(cgroup_memory_limit(proc.string(), sys.string()).bytes == 188743680ull, "hybrid");
    // a v1 memory controller co-mounted with another: <root>/<controllers>
    put(proc, "4:memory,hugetlb:/y\n");
    put(sys / "memory,hugetlb/memory.limit_in_bytes", "9223372036854771712\n");
    put(sys / "memory,hugetlb/y/memory.limit_in_bytes", "104857600\n");
    CHECK(cgroup_memory_limit(proc.string(), sys.string()).bytes == 104857600ull, "co-mounted v1");
    put(proc, "0::/bad\n");
    put(sys / "bad/memory.max", "lots\n");
    CHECK(!cgroup_memory_limit(proc.string(), sys.string()).limited, "not a number");
    CHECK(!cgroup_memory_limit((root / "missing").string(), sys.string()).limited, "no /proc file");
    // a path outside the namespace ("/../x") reads what it can
    put(proc, "0::/../lab/h1/worker\n");
    CHECK(cgroup_memory_limit(proc.string(), sys.string()).bytes == 104857600ull, "namespaced path");

    // the budget: the smaller of --memory-budget-mb and the cgroup's, with its source
    put(proc, "0::/lab/h1/worker\n");
    MemoryBudget b = memory_budget(64.0, proc.string(), sys.string());
    CHECK(b.bytes == 64ull << 20 && b.source == "--memory-budget-mb 64", "flag smaller: %s", b.source.c_str());
    b = memory_budget(512.0, proc.string(), sys.string());
    CHECK(b.bytes == 104857600ull && b.source.rfind("cgroup memory.max (", 0) == 0, "cgroup smaller: %s", b.source.c_str());
    b = memory_budget(0, (root / "missing").string(), sys.string());
    CHECK(b.bytes == 0, "no budget");

    // a token embedding read row by row: one batch's rows with fault-around, at most the tensor
    dgr::GgufTensor embd;
    embd.name = "token_embd.weight";
    embd.dims = {4096, 128256};
    embd.n_bytes = 128256ull * 2304;  // Q4_K rows of 4096
    embd.offset = 8192;
    CHECK(embedding_rows_bytes(embd, 528, 4096) == 528ull * 65536, "rows: %llu",
          (unsigned long long) embedding_rows_bytes(embd, 528, 4096));
    CHECK(embedding_rows_bytes(embd, 1u << 30, 4096) == (8192ull + 128256ull * 2304 + 4095) / 4096 * 4096 - 8192,
          "whole tensor at most");
    embd.dims = {65536, 64};          // rows wider than the fault-around: their pages plus one
    embd.n_bytes = 64ull * 65536 * 2;
    CHECK(embedding_rows_bytes(embd, 2, 4096) == 2ull * (131072 + 4096), "wide rows");

    // the verdict
    MemoryNeed n;
    n.layer_start = 0;
    n.layer_end = 10;
    n.n_layer = 20;
    n.max_sessions = 4;
    n.ctx_per_session = 1024;
    n.kv_cells = 4096;
    n.kv_per_cell = 1024;            // 1 KiB per cell: 4 MiB of KV
    n.kv = 4096ull * 1024;
    n.weights = 100ull << 20;
    n.compute = 10ull << 20;
    n.runtime = 30ull << 20;
    MemoryBudget flag{120ull << 20, "--memory-budget-mb 120"};
    CHECK(admission_refusal(n, flag, false).empty(), "fits (the flag does not count the runtime)");
    MemoryBudget cg{120ull << 20, "cgroup memory.max (/x/memory.max)"};
    std::string why = admission_refusal(n, cg, false);
    CHECK(why.find("the range itself is too large") != std::string::npos && why.find("runtime") != std::string::npos,
          "cgroup counts the process: %s", why.c_str());
    // KV too large: 112 MiB budget leaves 2 MiB = 2048 cells: 2 sessions of 1024, or 512 positions each
    MemoryBudget kvb{112ull << 20, "--memory-budget-mb 112"};
    why = admission_refusal(n, kvb, false);
    CHECK(why.find("need 114.0 MiB (weights 100.0 + KV 4.0 for 4 sessions x 1024 positions + compute 10.0)") !=
              std::string::npos, "need line: %s", why.c_str());
    CHECK(why.find("--memory-budget-mb 112") != std::string::npos, "source: %s", why.c_str());
    CHECK(why.find("would fit: --max-sessions 2 at --ctx-per-session 1024, or --ctx-per-session 512 at --max-sessions 4") !=
              std::string::npos, "what fits: %s", why.c_str());
    // the range alone too large: about half its layers fit
    MemoryBudget small{60ull << 20, "--memory-budget-mb 60"};
    why = admission_refusal(n, small, false);
    CHECK(why.find("the range itself is too large") != std::string::npos &&
              why.find("about 5 of its 10 layers") != std::string::npos, "range: %s", why.c_str());
    CHECK(admission_refusal(n, MemoryBudget{}, false).empty(), "no budget: admitted");
    const std::string j = need_json(n, kvb, why);
    CHECK(j.find("\"fits\":false") != std::string::npos && j.find("\"kv_bytes\":4194304") != std::string::npos, "%s",
          j.c_str());

    fs::remove_all(root);
    if (g_failures) std::fprintf(stderr, "%d failure(s)\n", g_failures);
    return g_failures ? 1 : 0;
}
