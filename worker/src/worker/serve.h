// `dgr-worker serve`: options, model backend, gRPC server, metrics listener, signals.
#pragma once

namespace dgr::worker {

// argv after "serve"; returns the process exit code.
int serve_main(int argc, char ** argv);
// argv after "plan-memory": what serve with the same options would need (docs/memory.md).
int plan_memory_main(int argc, char ** argv);

}  // namespace dgr::worker
