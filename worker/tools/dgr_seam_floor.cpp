// dgr-seam-floor: what splitting a model costs before any network or gRPC is involved.
//
// For one 2-shard split it decodes the same greedy generation of --sessions sequences in lock
// step (one row per sequence per step) three ways, interleaved per round so a shared host's load
// drifts over all of them alike:
//   whole        the whole model in this process (one llama_decode per step);
//   in_process   head then tail in this process (two llama_decode calls per step);
//   two_process  head in this process, tail in a child process, boundary rows and sampled ids
//                over a socketpair (two processes taking turns on the same cores, no gRPC).
// Contexts are made as the worker makes them (--max-sessions sequences, one KV stream each,
// --ctx-per-session cells each). Prints one JSON object: ms per step for every round, the
// medians, and whether the three ways sampled the same ids. `dgr bench route` runs it next to the
// route, so its profile can tell the cost of two processes from the cost of the transport.
//
//   dgr-seam-floor --model M.gguf --split 15 --threads 2 --sessions 1 --prompt-tokens 128 \
//                  --gen-tokens 64 --rounds 3
//
// Exit status 0 on success, 2 on a usage or load error.
#include "common/shard_model.h"

#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

struct Args {
    std::string model;
    int32_t split = 0;
    int32_t threads = 2;
    int32_t sessions = 1;
    int32_t prompt_tokens = 128;
    int32_t gen_tokens = 64;
    int32_t rounds = 3;
    int32_t max_sessions = 0;     // 0: --sessions
    int32_t ctx_per_session = 0;  // 0: prompt + gen + 16
};

[[noreturn]] void usage(const char * msg) {
    if (msg) std::fprintf(stderr, "dgr-seam-floor: error: %s\n", msg);
    std::fprintf(stderr,
                 "usage: dgr-seam-floor --model FILE --split LAYER [--threads N] [--sessions B]\n"
                 "                      [--prompt-tokens P] [--gen-tokens N] [--rounds R]\n"
                 "                      [--max-sessions S] [--ctx-per-session C]\n");
    std::exit(2);
}

int32_t int_arg(int argc, char ** argv, int & i, int32_t lo) {
    if (i + 1 >= argc) usage((std::string(argv[i]) + " needs a value").c_str());
    char * end = nullptr;
    const long v = std::strtol(argv[++i], &end, 10);
    if (end == argv[i] || *end != '\0' || v < lo || v > 1000000) {
        usage((std::string(argv[i - 1]) + ": expected an integer >= " + std::to_string(lo)).c_str());
    }
    return (int32_t) v;
}

Args parse_args(int argc, char ** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        if (k == "--model") {
            if (i + 1 >= argc) usage("--model needs a value");
            a.model = argv[++i];
        } else if (k == "--split") a.split = int_arg(argc, argv, i, 1);
        else if (k == "--threads") a.threads = int_arg(argc, argv, i, 1);
        else if (k == "--sessions") a.sessions = int_arg(argc, argv, i, 1);
        else if (k == "--prompt-tokens") a.prompt_tokens = int_arg(argc, argv, i, 1);
        else if (k == "--gen-tokens") a.gen_tokens = int_arg(argc, argv, i, 2);
        else if (k == "--rounds") a.rounds = int_arg(argc, argv, i, 1);
        else if (k == "--max-sessions") a.max_sessions = int_arg(argc, argv, i, 1);
        else if (k == "--ctx-per-session") a.ctx_per_session = int_arg(argc, argv, i, 1);
        else if (k == "-h" || k == "--help") usage(nullptr);
        else usage(("unknown argument " + k).c_str());
    }
    if (a.model.empty()) usage("--model is required");
    if (a.split <= 0) usage("--split is required");
    if (a.max_sessions == 0) a.max_sessions = a.sessions;
    if (a.max_sessions < a.sessions) usage("--max-sessions must be >= --sessions");
    if (a.ctx_per_session == 0) a.ctx_per_session = a.prompt_tokens + a.gen_tokens + 16;
    if (a.ctx_per_session < a.prompt_tokens + a.gen_tokens) usage("--ctx-per-session is smaller than prompt + gen");
    return a;
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

bool read_all(int fd, void * p, size_t n) {
    char * c = static_cast<char *>(p);
    while (n > 0) {
        const ssize_t k = read(fd, c, n);
        if (k <= 0) return false;
        c += k;
        n -= (size_t) k;
    }
    return true;
}

bool write_all(int fd, const void * p, size_t n) {
    const char * c = static_cast<const char *>(p);
    while (n > 0) {
        const ssize_t k = write(fd, c, n);
        if (k <= 0) return false;
        c += k;
        n -= (size_t) k;
    }
    return true;
}

// messages head -> tail: {op, n_rows, pos, seq} then n_rows x n_embd f32 rows
//   op 0: clear the cache; no reply
//   op 1: n_rows rows of one sequence `seq` from `pos`; reply: 1 sampled id (last row)
//   op 2: one row per sequence 0..n_rows-1, all at `pos`; reply: n_rows sampled ids
//   op 3: quit
struct Msg {
    int32_t op, n_rows, pos, seq;
};

llama_token argmax(const float * v, int32_t n) {
    return (llama_token) (std::max_element(v, v + n) - v);
}

std::unique_ptr<dgr::ShardContext> make_ctx(const dgr::ShardModel & m, const Args & a, std::string * err) {
    dgr::ShardContextOptions co;
    co.n_ctx = (uint32_t) (a.max_sessions * a.ctx_per_session);
    co.n_seq_max = (uint32_t) a.max_sessions;
    co.kv_unified = false;  // as the worker: one KV stream per session
    co.n_threads = a.threads;
    co.n_batch = co.n_ubatch = (uint32_t) std::max(512, a.prompt_tokens);
    return dgr::ShardContext::create(m, co, err);
}

std::unique_ptr<dgr::ShardModel> load(const std::string & path, int32_t start, int32_t end, std::string * err) {
    dgr::ShardModelOptions o;
    o.path = path;
    o.layer_start = start;
    o.layer_end = end;
    return dgr::ShardModel::load(o, err);
}

// The child: the tail, served over the socket until op 3 or EOF.
int serve_tail(const Args & a, int fd) {
    std::string err;
    auto model = load(a.model, a.split, 0, &err);
    auto ctx = model ? make_ctx(*model, a, &err) : nullptr;
    const int32_t ready = ctx ? 1 : 0;
    write_all(fd, &ready, sizeof ready);
    if (!ctx) {
        std::fprintf(stderr, "dgr-seam-floor: error: tail: %s\n", err.c_str());
        return 2;
    }
    const int32_t n_embd = model->n_embd(), n_vocab = model->n_vocab();
    std::vector<float> rows;
    dgr::ShardBatch b;
    std::vector<llama_token> out;
    Msg m{};
    while (read_all(fd, &m, sizeof m)) {
        if (m.op == 3) break;
        if (m.op == 0) {
            ctx->clear();
            continue;
        }
        rows.resize((size_t) m.n_rows * n_embd);
        if (!read_all(fd, rows.data(), rows.size() * sizeof(float))) break;
        b.clear();
        if (m.op == 1) {
            b.add_rows(rows.data(), m.n_rows, n_embd, m.pos, m.seq, true);
        } else {
            for (int32_t s = 0; s < m.n_rows; ++s) b.add_rows(rows.data() + (size_t) s * n_embd, 1, n_embd, m.pos, s, true);
        }
        if (ctx->decode(b, &err) != dgr::DecodeStatus::ok) {
            std::fprintf(stderr, "dgr-seam-floor: error: tail decode: %s\n", err.c_str());
            return 2;
        }
        out.clear();
        if (m.op == 1) out.push_back(argmax(ctx->logits_ith(m.n_rows - 1), n_vocab));
        else for (int32_t s = 0; s < m.n_rows; ++s) out.push_back(argmax(ctx->logits_ith(s), n_vocab));
        if (!write_all(fd, out.data(), out.size() * sizeof(llama_token))) break;
    }
    return 0;
}

std::string json_escape(const std::string & s) {
    std::string o;
    for (const char c : s) {
        if (c == '"' || c == '\\') o += '\\';
        if ((unsigned char) c < 0x20) continue;
        o += c;
    }
    return o;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

[[noreturn]] void die(const std::string & msg) {
    std::fprintf(stderr, "dgr-seam-floor: error: %s\n", msg.c_str());
    std::exit(2);
}

}  // namespace

int main(int argc, char ** argv) {
    const Args a = parse_args(argc, argv);
    llama_log_set(quiet_log, nullptr);

    // fork before anything starts threads (OpenMP teams do not survive a fork)
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) die("socketpair failed");
    const pid_t pid = fork();
    if (pid < 0) die("fork failed");
    llama_backend_init();
    if (pid == 0) {
        close(sv[0]);
        const int rc = serve_tail(a, sv[1]);
        llama_backend_free();
        _exit(rc);
    }
    close(sv[1]);
    const int fd = sv[0];

    std::string err;
    auto whole_m = load(a.model, 0, 0, &err);
    if (!whole_m) die(err);
    const int32_t n_layer = whole_m->n_layer(), n_embd = whole_m->n_embd(), n_vocab = whole_m->n_vocab();
    if (a.split >= n_layer) die("--split must be below the layer count " + std::to_string(n_layer));
    auto head_m = load(a.model, 0, a.split, &err);
    auto tail_m = head_m ? load(a.model, a.split, 0, &err) : nullptr;
    if (!tail_m) die(err);
    auto whole = make_ctx(*whole_m, a, &err);
    auto head = whole ? make_ctx(*head_m, a, &err) : nullptr;
    auto tail = head ? make_ctx(*tail_m, a, &err) : nullptr;
    if (!tail) die(err);
    int32_t ready = 0;
    if (!read_all(fd, &ready, sizeof ready) || !ready) die("the tail process did not start");

    const int32_t B = a.sessions, P = a.prompt_tokens, N = a.gen_tokens;
    auto prompt = [&](int32_t s) {
        std::vector<llama_token> t(P);
        for (int32_t i = 0; i < P; ++i) t[i] = 100 + (17 * i + 31 * s) % 1000;  // ordinary ids
        return t;
    };
    auto check = [&](dgr::DecodeStatus st) {
        if (st != dgr::DecodeStatus::ok) die("decode failed: " + err);
    };

    // one generation: returns ms per lock-step decode step and fills the sampled ids
    auto run_whole = [&](std::vector<llama_token> & ids, double & ms) {
        whole->clear();
        std::vector<llama_token> t(B);
        dgr::ShardBatch b;
        for (int32_t s = 0; s < B; ++s) {
            const auto p = prompt(s);
            b.clear();
            b.add_tokens(p.data(), P, 0, s, true);
            check(whole->decode(b, &err));
            t[s] = argmax(whole->logits_ith(P - 1), n_vocab);
        }
        const double t0 = now_s();
        for (int32_t i = 0; i < N; ++i) {
            b.clear();
            for (int32_t s = 0; s < B; ++s) b.add_tokens(&t[s], 1, P + i, s, true);
            check(whole->decode(b, &err));
            for (int32_t s = 0; s < B; ++s) ids.push_back(t[s] = argmax(whole->logits_ith(s), n_vocab));
        }
        ms = (now_s() - t0) * 1e3 / N;
    };
    auto run_in_process = [&](std::vector<llama_token> & ids, double & ms, double & head_ms, double & tail_ms) {
        head->clear();
        tail->clear();
        std::vector<llama_token> t(B);
        dgr::ShardBatch b, b2;
        for (int32_t s = 0; s < B; ++s) {
            const auto p = prompt(s);
            b.clear();
            b.add_tokens(p.data(), P, 0, s, true);
            check(head->decode(b, &err));
            b2.clear();
            b2.add_rows(head->boundary_output(), P, n_embd, 0, s, true);
            check(tail->decode(b2, &err));
            t[s] = argmax(tail->logits_ith(P - 1), n_vocab);
        }
        double th = 0, tt = 0;
        const double t0 = now_s();
        for (int32_t i = 0; i < N; ++i) {
            const double x0 = now_s();
            b.clear();
            for (int32_t s = 0; s < B; ++s) b.add_tokens(&t[s], 1, P + i, s, true);
            check(head->decode(b, &err));
            const double x1 = now_s();
            b2.clear();
            for (int32_t s = 0; s < B; ++s) b2.add_rows(head->boundary_output() + (size_t) s * n_embd, 1, n_embd, P + i, s, true);
            check(tail->decode(b2, &err));
            for (int32_t s = 0; s < B; ++s) ids.push_back(t[s] = argmax(tail->logits_ith(s), n_vocab));
            const double x2 = now_s();
            th += x1 - x0;
            tt += x2 - x1;
        }
        ms = (now_s() - t0) * 1e3 / N;
        head_ms = th * 1e3 / N;
        tail_ms = tt * 1e3 / N;
    };
    auto send = [&](Msg m, const float * rows) {
        if (!write_all(fd, &m, sizeof m) || (m.n_rows > 0 && rows &&
            !write_all(fd, rows, (size_t) m.n_rows * n_embd * sizeof(float)))) {
            die("the tail process went away");
        }
    };
    auto run_two_process = [&](std::vector<llama_token> & ids, double & ms, double & head_ms) {
        head->clear();
        send(Msg{0, 0, 0, 0}, nullptr);
        std::vector<llama_token> t(B);
        dgr::ShardBatch b;
        for (int32_t s = 0; s < B; ++s) {
            const auto p = prompt(s);
            b.clear();
            b.add_tokens(p.data(), P, 0, s, true);
            check(head->decode(b, &err));
            send(Msg{1, P, 0, s}, head->boundary_output());
            if (!read_all(fd, &t[s], sizeof(llama_token))) die("the tail process went away");
        }
        double th = 0;
        const double t0 = now_s();
        for (int32_t i = 0; i < N; ++i) {
            const double x0 = now_s();
            b.clear();
            for (int32_t s = 0; s < B; ++s) b.add_tokens(&t[s], 1, P + i, s, true);
            check(head->decode(b, &err));
            th += now_s() - x0;
            send(Msg{2, B, P + i, 0}, head->boundary_output());
            if (!read_all(fd, t.data(), (size_t) B * sizeof(llama_token))) die("the tail process went away");
            ids.insert(ids.end(), t.begin(), t.end());
        }
        ms = (now_s() - t0) * 1e3 / N;
        head_ms = th * 1e3 / N;
    };

    std::vector<double> w_ms, ip_ms, tp_ms;
    bool agree = true;
    std::string rounds_json;
    for (int32_t r = 0; r < a.rounds; ++r) {
        std::vector<llama_token> iw, ii, it;
        double mw = 0, mi = 0, hi = 0, ti = 0, mt = 0, ht = 0;
        run_whole(iw, mw);
        run_in_process(ii, mi, hi, ti);
        run_two_process(it, mt, ht);
        agree = agree && iw == ii && ii == it;
        w_ms.push_back(mw);
        ip_ms.push_back(mi);
        tp_ms.push_back(mt);
        char buf[512];
        std::snprintf(buf, sizeof buf,
                      "%s{\"whole_ms_per_step\":%.4f,\"in_process_ms_per_step\":%.4f,\"in_process_head_ms\":%.4f,"
                      "\"in_process_tail_ms\":%.4f,\"two_process_ms_per_step\":%.4f,\"two_process_head_ms\":%.4f}",
                      r ? "," : "", mw, mi, hi, ti, mt, ht);
        rounds_json += buf;
    }
    send(Msg{3, 0, 0, 0}, nullptr);
    int status = 0;
    waitpid(pid, &status, 0);

    std::vector<double> r_ip, r_tp;
    for (size_t i = 0; i < w_ms.size(); ++i) {
        r_ip.push_back(w_ms[i] / ip_ms[i]);
        r_tp.push_back(w_ms[i] / tp_ms[i]);
    }
    std::printf("{\"kind\":\"dgr.seam_floor/v1\",\"model\":\"%s\",\"n_layer\":%d,\"split\":%d,\"threads\":%d,"
                "\"sessions\":%d,\"prompt_tokens\":%d,\"gen_tokens\":%d,\"max_sessions\":%d,\"ctx_per_session\":%d,"
                "\"rounds\":[%s],\"median\":{\"whole_ms_per_step\":%.4f,\"in_process_ms_per_step\":%.4f,"
                "\"two_process_ms_per_step\":%.4f,\"in_process_vs_whole\":%.4f,\"two_process_vs_whole\":%.4f},"
                "\"same_tokens\":%s}\n",
                json_escape(a.model).c_str(), n_layer, a.split, a.threads, B, P, N, a.max_sessions, a.ctx_per_session,
                rounds_json.c_str(), median(w_ms), median(ip_ms), median(tp_ms), median(r_ip), median(r_tp),
                agree ? "true" : "false");
    llama_backend_free();
    return 0;
}
