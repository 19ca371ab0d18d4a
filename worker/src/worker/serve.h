// `dgr-worker serve`: options, model backend, gRPC server, metrics listener, signals.
#pragma once

#include "worker/backend.h"
#include "worker/memory_plan.h"
#include "worker/serve_options.h"

#include <cstdint>
#include <memory>

namespace dgr::worker {

// argv after "serve"; returns the process exit code.
int serve_main(int argc, char ** argv);
// argv after "plan-memory": what serve with the same options would need (docs/memory.md).
int plan_memory_main(int argc, char ** argv);
// `dgr-worker probe`: load as serve would, measure the range's costs (capability_probe.h)
int probe_main(int argc, char ** argv);
// The backend serve (and probe) runs: the fake model, or the GGUF with its identity proven and
// its memory admitted. Returns -1 when loaded, else the exit code (the reason printed).
int load_backend(ServeOptions & o, uint64_t & kv_cells, MemoryBudget & budget, std::unique_ptr<ModelBackend> & backend);

}  // namespace dgr::worker
