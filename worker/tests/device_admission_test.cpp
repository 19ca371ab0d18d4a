// Device (VRAM) admission (worker/device_plan.h) through the fake backend: the fake device that
// `serve --fake-model` loads with (load_backend, the code serve runs), what GetCapability and the
// metrics say of it, the refusal when the need exceeds its memory (exit 2, both figures), the
// option refusals, and the refusal line of a real device's need by part with what would fit.
#include "worker/device_memory.h"
#include "worker/device_plan.h"
#include "worker/metrics.h"
#include "worker/scheduler.h"
#include "worker/serve.h"
#include "worker/serve_options.h"

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "check.h"

using namespace dgr::worker;

namespace {

constexpr uint64_t kMiB = 1ull << 20;

int parse(std::vector<std::string> args, ServeOptions * o) {
    std::vector<char *> argv;
    for (auto & a : args) argv.push_back(a.data());
    return parse_serve_options((int) argv.size(), argv.data(), o);
}

// `serve` with these arguments up to the loaded backend: load_backend's code (-1: loaded)
int load(std::vector<std::string> args, std::unique_ptr<ModelBackend> * backend) {
    ServeOptions o;
    const int rc = parse(std::move(args), &o);
    if (rc >= 0) return rc;
    uint64_t kv_cells = 0;
    MemoryBudget budget;
    return load_backend(o, kv_cells, budget, *backend);
}

bool contains(const std::string & s, const std::string & part) { return s.find(part) != std::string::npos; }

// the value of `name` with device_class `cls` among the samples (-1: none)
double sample(const std::vector<Sample> & samples, const std::string & name, const std::string & cls) {
    for (const Sample & s : samples) {
        const auto it = s.labels.find("device_class");
        if (s.name == name && it != s.labels.end() && it->second == cls) return s.value;
    }
    return -1;
}

}  // namespace

int main() {
    const HostMemory host = read_host_memory();

    // the default fake device: class cpu, the host's RAM, nothing predicted
    std::unique_ptr<ModelBackend> b;
    CHECK(load({"--fake-model"}, &b) == -1 && b, "default fake loads");
    if (b) {
        const ComputeDevice & d = b->info().device;
        CHECK(d.device_class == "cpu" && d.backend == "cpu" && !d.accelerator, "default class '%s'", d.device_class.c_str());
        CHECK(host.total == 0 || d.memory_total == host.total, "host RAM: %llu", (unsigned long long) d.memory_total);
        CHECK(d.memory_predicted == 0, "nothing predicted");
        const auto cap = capability_of(b->info(), fit_options(SchedulerOptions{}, b->info()));
        CHECK(cap.has_device() && cap.device().device_class() == "cpu" && cap.device().memory_total_bytes() == d.memory_total,
              "capability device");
    }

    // a named class with its own memory and need: admitted, reported
    b.reset();
    CHECK(load({"--fake-model", "--fake-device-class", "cuda:sm_90", "--fake-device-memory-mb", "4096",
                "--fake-device-need-mb", "1000"}, &b) == -1 && b, "fits");
    if (b) {
        const ComputeDevice & d = b->info().device;
        CHECK(d.device_class == "cuda:sm_90" && d.backend == "cuda" && d.accelerator, "class '%s'", d.device_class.c_str());
        CHECK(d.memory_total == 4096 * kMiB && d.memory_free == 4096 * kMiB && d.memory_predicted == 1000 * kMiB,
              "memory %llu/%llu, predicted %llu", (unsigned long long) d.memory_free, (unsigned long long) d.memory_total,
              (unsigned long long) d.memory_predicted);
        const auto cap = capability_of(b->info(), fit_options(SchedulerOptions{}, b->info()));
        CHECK(cap.device().device_class() == "cuda:sm_90" && cap.device().memory_predicted_bytes() == 1000 * kMiB,
              "capability device");
        // the metrics, labelled with the class
        Metrics m;
        Gauges g;
        g.device_class = d.device_class;
        g.device_memory_total_bytes = d.memory_total;
        g.device_memory_free_bytes = d.memory_free;
        g.device_memory_predicted_bytes = d.memory_predicted;
        const auto samples = Metrics::samples(m.families(g));
        CHECK(sample(samples, "dgr_device_memory_total_bytes", "cuda:sm_90") == 4096.0 * kMiB, "total metric");
        CHECK(sample(samples, "dgr_device_memory_free_bytes", "cuda:sm_90") == 4096.0 * kMiB, "free metric");
        CHECK(sample(samples, "dgr_device_memory_predicted_bytes", "cuda:sm_90") == 1000.0 * kMiB, "predicted metric");
        CHECK(contains(Metrics::prometheus_text(m.families(g)), "dgr_device_memory_predicted_bytes{device_class=\"cuda:sm_90\"}"),
              "prometheus text");
    }

    // the need equal to the memory fits; one MiB more is refused before anything is made
    b.reset();
    CHECK(load({"--fake-model", "--fake-device-memory-mb", "2048", "--fake-device-need-mb", "2048"}, &b) == -1, "equal fits");
    b.reset();
    CHECK(load({"--fake-model", "--fake-device-memory-mb", "2048", "--fake-device-need-mb", "2049"}, &b) == 2 && !b,
          "above the memory: exit 2");
    // without --fake-device-memory-mb the need is reported, never refused
    b.reset();
    CHECK(load({"--fake-model", "--fake-device-need-mb", "16777216"}, &b) == -1 && b &&
          b->info().device.memory_predicted == 16777216ull * kMiB, "no memory figure: admitted");

    // the refusal line: both figures, the parts
    const ComputeDevice fd = fake_device("vulkan:nvidia", 2048, 3000, host);
    const MemoryNeed fn = fake_device_need(0, 8, 8, 16, 2048, 3000);
    const std::string why = device_admission_refusal(fn, fd);
    CHECK(contains(why, "3000.0 MiB") && contains(why, "free memory of 2048.0 MiB") && contains(why, "(vulkan:nvidia)") &&
          contains(why, "layers [0, 8)"), "refusal: %s", why.c_str());
    CHECK(device_admission_refusal(fake_device_need(0, 8, 8, 16, 2048, 2048), fd).empty(), "fits");
    uint64_t free = 0, total = 0;
    DeviceMemoryReader(fake_device_memory_read(512)).get(&free, &total);
    CHECK(free == 512 * kMiB && total == 512 * kMiB, "fixed fake memory");

    // a real device's need by part, and what would fit: 16 sessions x 50 MiB of KV beside
    // 1356 MiB of weights, compute and allowance in 2000 MiB free -> 12 sessions
    MemoryNeed n;
    n.layer_start = 0;
    n.layer_end = 24;
    n.max_sessions = 16;
    n.ctx_per_session = 4096;
    n.device_weights = 1000 * kMiB;
    n.device_kv = 800 * kMiB;
    n.device_compute = 100 * kMiB;
    n.device_allowance = 256 * kMiB;
    ComputeDevice gpu;
    gpu.name = "CUDA0";
    gpu.device_class = "cuda:sm_90";
    gpu.accelerator = true;
    gpu.memory_total = 8192 * kMiB;
    gpu.memory_free = 2000 * kMiB;
    const std::string r = device_admission_refusal(n, gpu);
    CHECK(contains(r, "need 2156.0 MiB on the device CUDA0 (cuda:sm_90)") &&
          contains(r, "weights 1000.0 + KV 800.0 for 16 sessions x 4096 positions + compute 100.0 + allowance 256.0") &&
          contains(r, "free memory of 2000.0 MiB (total 8192.0 MiB)") && contains(r, "about --max-sessions 12"),
          "real refusal: %s", r.c_str());
    gpu.memory_free = 1300 * kMiB;
    CHECK(contains(device_admission_refusal(n, gpu), "the offloaded range itself does not fit"), "weights alone");
    gpu.memory_free = 2156 * kMiB;
    CHECK(device_admission_refusal(n, gpu).empty(), "exactly fits");
    gpu.memory_free = gpu.memory_total = 0;
    CHECK(device_admission_refusal(n, gpu).empty(), "no memory figures: not admitted against");
    const std::string j = device_need_json(n, gpu, "");
    CHECK(contains(j, "\"need_bytes\":" + std::to_string(2156 * kMiB)) && contains(j, "\"fits\":true"), "json %s", j.c_str());

    // the options: only with --fake-model, and a valid class (each parse from fresh options)
    const auto rc = [](std::vector<std::string> args) {
        ServeOptions o;
        return parse(std::move(args), &o);
    };
    CHECK(rc({"--model", "m.gguf", "--fake-device-class", "cpu"}) == 2, "class without --fake-model");
    CHECK(rc({"--model", "m.gguf", "--fake-device-memory-mb", "1"}) == 2, "memory without --fake-model");
    CHECK(rc({"--model", "m.gguf", "--fake-device-need-mb", "0"}) == 2, "need without --fake-model");
    CHECK(rc({"--fake-model", "--fake-device-class", "CUDA:SM_90"}) == 2, "upper case class");
    CHECK(rc({"--fake-model", "--fake-device-class", ""}) == 2, "empty class");
    CHECK(rc({"--fake-model", "--fake-device-class", std::string(65, 'a')}) == 2, "long class");
    CHECK(rc({"--fake-model", "--fake-device-memory-mb", "16777217"}) == 2, "memory bound");
    CHECK(rc({"--model", "m.gguf"}) == -1, "--model alone parses");
    ServeOptions ok;
    CHECK(parse({"--fake-model", "--fake-device-class", "vulkan:llvmpipe"}, &ok) == -1 &&
          ok.fake_device_class == "vulkan:llvmpipe", "valid class");

    if (g_failures) {
        std::fprintf(stderr, "device_admission_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("device_admission_test: ok\n");
    return 0;
}
