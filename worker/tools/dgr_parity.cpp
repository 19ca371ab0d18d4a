// dgr-parity: whole model vs the same model as disjoint layer ranges, chained in-process.
//
// Over 500 lines on purpose: one standalone measuring program (parity, memory and batched modes
// share its model loading, batch building and JSON output); it links nothing of the worker.
//
// Parity mode (default): runs the whole model and, for every --split, the shards of that split
// (boundary rows of shard i are the input of shard i+1) over one prompt and N greedy tokens;
// compares prefill logits of every prompt position (max abs diff, top-1 agreement) and the greedy
// tokens, and prints one JSON object on stdout. Exit status 0 when every split gives the same
// greedy tokens and top-1 everywhere and its max abs diff is within --tolerance, 1 otherwise,
// 2 on a usage or load error.
//
// Memory mode (--memory --range A:B): loads one range in this process, decodes a short prompt
// (so the weights it uses are touched) and prints RSS / mapped bytes / KV bytes as JSON.
//
//   dgr-parity --model M.gguf --split 15,30 --split 7,23,30 --prompt "..." --n-predict 32
//   dgr-parity --model M.gguf --split 0:15:30 --slices head.gguf,tail.gguf --tokens 1,2,3
//   dgr-parity --model M.gguf --memory --range 0:15 --n-ctx 2048
#include "common/shard_model.h"

#include "llama.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

struct Args {
    std::string model;
    std::vector<std::vector<int32_t>> splits;  // boundaries, e.g. {15, 30}
    std::vector<std::string> slices;           // optional per-shard files (one split only)
    std::string prompt;
    std::vector<llama_token> tokens;
    int32_t n_random = 0;
    uint32_t seed = 1;
    int32_t n_predict = 32;
    int32_t n_seq = 1;   // sequences decoded together in every batch
    bool kv_unified = true;  // with n_seq > 1: one KV cell pool for all sequences (as the worker)
    uint32_t n_ctx = 0;  // 0: prompt + n_predict rounded up
    int32_t n_threads = 2;
    int32_t shard_threads = 0;  // threads of the split shards (0: --threads)
    uint32_t shard_ubatch = 0;  // n_ubatch of the split shards (0: as the whole model)
    double tolerance = 1e-3;
    bool verbose = false;
    bool memory = false;
    int32_t range_start = 0;
    int32_t range_end = 0;
    bool no_mmap = false;
};

// ---------------------------------------------------------------------------- logging

// the KV caches a context created, summed over its llama_kv_cache size lines (an interleaved
// sliding-window model such as Gemma 3 has two: the global and the SWA cache)
struct KvLog {
    double mib = 0.0;
    long cells = -1;        // the largest cache's cells
    long layers = -1;       // layers over all caches
    long cell_layers = 0;   // sum of cells x layers over all caches
};

bool g_verbose = false;
KvLog g_kv;        // last llama_kv_cache size line seen
double g_model_buf_mib = 0.0;  // sum of the "model buffer size" lines (weights allocated or mapped)
std::string g_line;

void log_cb(ggml_log_level level, const char * text, void *) {
    g_line += text;
    size_t nl;
    while ((nl = g_line.find('\n')) != std::string::npos) {
        const std::string line = g_line.substr(0, nl);
        g_line.erase(0, nl + 1);
        const char * p = std::strstr(line.c_str(), "llama_kv_cache: size =");
        if (p) {
            double mib = 0;
            unsigned cells = 0;
            int layers = 0;
            if (std::sscanf(p, "llama_kv_cache: size = %lf MiB (%u cells, %d layers", &mib, &cells, &layers) == 3) {
                g_kv.mib += mib;
                g_kv.cells = std::max(g_kv.cells, (long) cells);
                g_kv.layers = std::max(g_kv.layers, 0L) + layers;
                g_kv.cell_layers += (long) cells * layers;
            }
        }
        const char * q = std::strstr(line.c_str(), "model buffer size =");
        if (q) {
            g_model_buf_mib += std::atof(q + std::strlen("model buffer size ="));
        }
        if (g_verbose || level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
            std::fprintf(stderr, "%s\n", line.c_str());
        }
    }
}

// ---------------------------------------------------------------------------- args

[[noreturn]] void usage(const char * argv0, const char * why) {
    if (why) {
        std::fprintf(stderr, "%s: error: %s\n", argv0, why);
    }
    std::fprintf(stderr,
        "usage: %s --model M.gguf [--split B1,B2,..,n_layer]... [--slices f1,f2,..]\n"
        "          [--prompt TEXT | --tokens ID,ID,.. | --n-random N [--seed S]] [--n-predict N]\n"
        "          [--n-seq K [--kv-per-seq]] [--n-ctx N] [--threads N]\n"
        "          [--shard-threads N] [--shard-ubatch N] [--tolerance X] [--verbose]\n"
        "       %s --model M.gguf --memory --range A:B [--n-ctx N] [--n-random N] [--no-mmap]\n"
        "  a split lists the end of every shard: 15,30 = [0,15) [15,30); 7:23:30 works too\n"
        "  --n-seq K decodes K sequences (the prompt rotated by 0..K-1) together in every batch\n"
        "  (one unified KV cache, as the worker; --kv-per-seq gives each sequence its own)\n",
        argv0, argv0);
    std::exit(2);
}

std::vector<int32_t> parse_ints(const std::string & s) {
    std::vector<int32_t> out;
    std::string cur;
    for (char c : s + ",") {
        if (c == ',' || c == ':') {
            if (!cur.empty()) {
                out.push_back((int32_t) std::strtol(cur.c_str(), nullptr, 10));
            }
            cur.clear();
        } else {
            cur += c;
        }
    }
    return out;
}

std::vector<std::string> parse_list(const std::string & s) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (!item.empty()) {
            out.push_back(item);
        }
    }
    return out;
}

Args parse_args(int argc, char ** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) {
                usage(argv[0], ("missing value for " + k).c_str());
            }
            return argv[++i];
        };
        if (k == "--model" || k == "-m") a.model = val();
        else if (k == "--split") a.splits.push_back(parse_ints(val()));
        else if (k == "--slices") a.slices = parse_list(val());
        else if (k == "--prompt" || k == "-p") a.prompt = val();
        else if (k == "--tokens") { for (int32_t t : parse_ints(val())) a.tokens.push_back(t); }
        else if (k == "--n-random") a.n_random = std::atoi(val().c_str());
        else if (k == "--seed") a.seed = (uint32_t) std::strtoul(val().c_str(), nullptr, 10);
        else if (k == "--n-predict" || k == "-n") a.n_predict = std::atoi(val().c_str());
        else if (k == "--n-seq") a.n_seq = std::max(1, std::atoi(val().c_str()));
        else if (k == "--kv-per-seq") a.kv_unified = false;
        else if (k == "--n-ctx" || k == "-c") a.n_ctx = (uint32_t) std::atoi(val().c_str());
        else if (k == "--threads" || k == "-t") a.n_threads = std::atoi(val().c_str());
        else if (k == "--shard-threads") a.shard_threads = std::atoi(val().c_str());
        else if (k == "--shard-ubatch") a.shard_ubatch = (uint32_t) std::atoi(val().c_str());
        else if (k == "--tolerance") a.tolerance = std::atof(val().c_str());
        else if (k == "--verbose" || k == "-v") a.verbose = true;
        else if (k == "--memory") a.memory = true;
        else if (k == "--no-mmap") a.no_mmap = true;
        else if (k == "--range") {
            const auto r = parse_ints(val());
            if (r.size() != 2) usage(argv[0], "--range wants A:B");
            a.range_start = r[0];
            a.range_end = r[1];
        }
        else if (k == "--help" || k == "-h") usage(argv[0], nullptr);
        else usage(argv[0], ("unknown argument " + k).c_str());
    }
    if (a.model.empty()) usage(argv[0], "--model is required");
    return a;
}

// ---------------------------------------------------------------------------- JSON

// `s` with every byte that is not part of a valid UTF-8 sequence replaced by U+FFFD.
std::string utf8_clean(const std::string & s) {
    std::string o;
    for (size_t i = 0; i < s.size();) {
        const unsigned char c = (unsigned char) s[i];
        const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        bool ok = n > 0 && i + n <= s.size();
        for (size_t k = 1; ok && k < n; ++k) {
            ok = ((unsigned char) s[i + k] >> 6) == 0x2;
        }
        if (ok) {
            o.append(s, i, n);
            i += n;
        } else {
            o += "\xEF\xBF\xBD";
            i += 1;
        }
    }
    return o;
}

std::string jstr(const std::string & raw) {
    const std::string s = utf8_clean(raw);
    std::string o = "\"";
    for (char c : s) {
        switch (c) {
            case '"':  o += "\\\""; break;
            case '\\': o += "\\\\"; break;
            case '\n': o += "\\n"; break;
            case '\t': o += "\\t"; break;
            default:
                if ((unsigned char) c < 0x20) {
                    char b[8];
                    std::snprintf(b, sizeof(b), "\\u%04x", c);
                    o += b;
                } else {
                    o += c;
                }
        }
    }
    return o + "\"";
}

std::string jnum(double v) {
    if (!std::isfinite(v)) return "null";
    char b[64];
    std::snprintf(b, sizeof(b), "%.9g", v);
    return b;
}

template <typename T>
std::string jarr(const std::vector<T> & v) {
    std::string o = "[";
    for (size_t i = 0; i < v.size(); ++i) {
        if (i) o += ",";
        o += std::to_string(v[i]);
    }
    return o + "]";
}

template <typename T>
std::string jarr2(const std::vector<std::vector<T>> & v) {
    std::string o = "[";
    for (size_t i = 0; i < v.size(); ++i) {
        o += (i ? "," : "") + jarr(v[i]);
    }
    return o + "]";
}

// ---------------------------------------------------------------------------- running

struct Shard {
    std::unique_ptr<dgr::ShardModel> model;
    std::unique_ptr<dgr::ShardContext> ctx;
    KvLog kv;
};

bool open_shard(Shard & s, const std::string & path, int32_t start, int32_t end, const Args & a, uint32_t n_ctx,
                std::string * err) {
    dgr::ShardModelOptions mo;
    mo.path = path;
    mo.layer_start = start;
    mo.layer_end = end;
    mo.use_mmap = !a.no_mmap;
    s.model = dgr::ShardModel::load(mo, err);
    if (!s.model) return false;
    dgr::ShardContextOptions co;
    co.n_ctx = n_ctx;
    co.n_batch = n_ctx;
    co.n_ubatch = a.shard_ubatch > 0 ? std::min(n_ctx, a.shard_ubatch) : std::min<uint32_t>(n_ctx, 512);
    co.n_seq_max = (uint32_t) a.n_seq;
    co.kv_unified = a.n_seq > 1 && a.kv_unified;
    co.n_threads = a.shard_threads > 0 ? a.shard_threads : a.n_threads;
    g_kv = {};
    s.ctx = dgr::ShardContext::create(*s.model, co, err);
    s.kv = g_kv;
    return (bool) s.ctx;
}

// One row of a forward: a token of one sequence at one position.
struct Row {
    llama_token token;
    llama_pos pos;
    llama_seq_id seq;
    bool logits;
};

// Runs one forward over a chain of shards (a single shard = the whole model): the head decodes
// token ids, every later shard the boundary rows of the previous one. Returns the logits of the
// rows that asked for them, in row order (n_out x n_vocab).
bool forward(std::vector<Shard> & chain, const std::vector<Row> & in, std::vector<float> & logits_out,
             std::string * err) {
    const int32_t n = (int32_t) in.size();
    std::vector<float> rows;
    for (size_t i = 0; i < chain.size(); ++i) {
        Shard & s = chain[i];
        dgr::ShardBatch b;
        for (int32_t r = 0; r < n; ++r) {
            if (i == 0) {
                b.add_tokens(&in[r].token, 1, in[r].pos, in[r].seq, in[r].logits);
            } else {
                b.add_rows(rows.data() + (size_t) r * s.model->n_embd(), 1, s.model->n_embd(), in[r].pos, in[r].seq,
                           in[r].logits);
            }
        }
        const dgr::DecodeStatus st = s.ctx->decode(b, err);
        if (st != dgr::DecodeStatus::ok) return false;
        if (!s.model->is_tail()) {
            const float * out = s.ctx->boundary_output();
            if (!out || s.ctx->boundary_rows() != n) {
                if (err) *err = "non-tail shard returned no boundary output for every row";
                return false;
            }
            rows.assign(out, out + (size_t) n * s.model->n_embd());
        }
    }
    Shard & tail = chain.back();
    const int32_t n_vocab = tail.model->n_vocab();
    logits_out.clear();
    for (int32_t r = 0; r < n; ++r) {
        if (!in[r].logits) continue;
        const float * l = tail.ctx->logits_ith(r);
        if (!l) {
            if (err) *err = "tail returned no logits";
            return false;
        }
        logits_out.insert(logits_out.end(), l, l + n_vocab);
    }
    return true;
}

int32_t argmax(const float * l, int32_t n) {
    return (int32_t) (std::max_element(l, l + n) - l);
}

// The prompt of sequence s: the prompt rotated by s positions (s = 0 is the prompt itself).
std::vector<llama_token> seq_prompt(const std::vector<llama_token> & prompt, int32_t s) {
    std::vector<llama_token> p(prompt);
    std::rotate(p.begin(), p.begin() + (s % (int32_t) p.size()), p.end());
    return p;
}

struct RunResult {
    std::vector<float> prefill;             // (n_seq * n_prompt) x n_vocab, sequence-major
    std::vector<std::vector<float>> steps;  // per step: n_seq x n_vocab logits that picked the tokens
    std::vector<std::vector<llama_token>> generated;  // per sequence
};

// Prefill of all sequences in one batch, then n_predict greedy steps, all sequences per batch.
bool run_chain(std::vector<Shard> & chain, const std::vector<llama_token> & prompt, int32_t n_seq,
               int32_t n_predict, RunResult & r, std::string * err) {
    const int32_t n_vocab = chain.back().model->n_vocab();
    const int32_t n_prompt = (int32_t) prompt.size();
    std::vector<Row> rows;
    for (int32_t s = 0; s < n_seq; ++s) {
        const auto p = seq_prompt(prompt, s);
        for (int32_t i = 0; i < n_prompt; ++i) rows.push_back({p[i], i, s, true});
    }
    if (!forward(chain, rows, r.prefill, err)) return false;
    std::vector<float> last((size_t) n_seq * n_vocab);
    for (int32_t s = 0; s < n_seq; ++s) {
        std::copy_n(r.prefill.begin() + ((size_t) s * n_prompt + n_prompt - 1) * n_vocab, n_vocab,
                    last.begin() + (size_t) s * n_vocab);
    }
    r.generated.assign(n_seq, {});
    for (int32_t k = 0; k < n_predict; ++k) {
        rows.clear();
        for (int32_t s = 0; s < n_seq; ++s) {
            const llama_token t = argmax(last.data() + (size_t) s * n_vocab, n_vocab);
            r.generated[s].push_back(t);
            rows.push_back({t, n_prompt + k, s, true});
        }
        r.steps.push_back(last);
        if (k + 1 == n_predict) break;
        if (!forward(chain, rows, last, err)) return false;
    }
    return true;
}

// ---------------------------------------------------------------------------- memory

struct ProcMem {
    long long vm_rss = -1, rss_anon = -1, rss_file = -1, vm_hwm = -1;
    long long map_size = 0, map_rss = 0;  // mappings of the model file
};

long long kb_field(const std::string & text, const char * key) {
    const size_t p = text.find(key);
    if (p == std::string::npos) return -1;
    return std::atoll(text.c_str() + p + std::strlen(key)) * 1024;
}

ProcMem read_proc_mem(const std::string & model_path) {
    ProcMem m;
    std::ifstream st("/proc/self/status");
    std::string s((std::istreambuf_iterator<char>(st)), std::istreambuf_iterator<char>());
    m.vm_rss = kb_field(s, "VmRSS:");
    m.vm_hwm = kb_field(s, "VmHWM:");
    m.rss_anon = kb_field(s, "RssAnon:");
    m.rss_file = kb_field(s, "RssFile:");

    char real[PATH_MAX];
    const std::string target = realpath(model_path.c_str(), real) ? std::string(real) : model_path;
    std::ifstream sm("/proc/self/smaps");
    std::string line;
    bool in_model = false;
    while (std::getline(sm, line)) {
        const bool header = !line.empty() && std::isxdigit((unsigned char) line[0]) &&
                            line.find('-') < line.find(' ');
        if (header) {
            const size_t slash = line.find('/');
            in_model = slash != std::string::npos && line.substr(slash) == target;
            continue;
        }
        if (!in_model) continue;
        if (line.rfind("Size:", 0) == 0) m.map_size += std::atoll(line.c_str() + 5) * 1024;
        else if (line.rfind("Rss:", 0) == 0) m.map_rss += std::atoll(line.c_str() + 4) * 1024;
    }
    return m;
}

std::string mem_json(const ProcMem & m) {
    return std::string("{") +
        "\"vm_rss_bytes\":" + std::to_string(m.vm_rss) +
        ",\"vm_hwm_bytes\":" + std::to_string(m.vm_hwm) +
        ",\"rss_anon_bytes\":" + std::to_string(m.rss_anon) +
        ",\"rss_file_bytes\":" + std::to_string(m.rss_file) +
        ",\"model_mapped_bytes\":" + std::to_string(m.map_size) +
        ",\"model_mapped_resident_bytes\":" + std::to_string(m.map_rss) + "}";
}

std::string kv_json(const KvLog & kv, const dgr::ShardModel & model) {
    // f16 K and V (the context defaults): cells x layers x (k + v) x head_dim x n_head_kv x 2 bytes;
    // the head dim is <arch>.attention.key_length where the model sets it (Gemma 3, Qwen3)
    long long head_dim = (long long) model.n_embd() / llama_model_n_head(model.get());
    char arch[64] = {0};
    char key_length[32] = {0};
    if (llama_model_meta_val_str(model.get(), "general.architecture", arch, sizeof arch) > 0 &&
        llama_model_meta_val_str(model.get(), (std::string(arch) + ".attention.key_length").c_str(),
                                 key_length, sizeof key_length) > 0) {
        head_dim = std::atoll(key_length);
    }
    const long long n_embd_gqa = head_dim * llama_model_n_head_kv(model.get());
    const long long bytes = kv.cells < 0 ? -1 : (long long) kv.cell_layers * 2 * n_embd_gqa * 2;
    return std::string("{\"kv_cells\":") + std::to_string(kv.cells) + ",\"kv_layers\":" + std::to_string(kv.layers) +
           ",\"kv_bytes\":" + std::to_string(bytes) + ",\"kv_mib_logged\":" + jnum(kv.mib) + "}";
}

std::vector<llama_token> prompt_tokens(const Args & a, const dgr::ShardModel & head) {
    if (!a.tokens.empty()) return a.tokens;
    if (!a.prompt.empty()) return head.tokenize(a.prompt, true);
    std::mt19937 rng(a.seed);
    std::uniform_int_distribution<int32_t> d(0, head.n_vocab() - 1);
    std::vector<llama_token> t;
    for (int32_t i = 0; i < std::max(1, a.n_random); ++i) t.push_back(d(rng));
    return t;
}

// The pieces of `tokens` up to the first end-of-generation token (what llama-simple prints).
std::string detokenize(const dgr::ShardModel & m, const std::vector<llama_token> & tokens) {
    std::string out;
    for (llama_token t : tokens) {
        if (llama_vocab_is_eog(m.vocab(), t)) break;
        char buf[256];
        const int n = llama_token_to_piece(m.vocab(), t, buf, sizeof(buf), 0, true);
        if (n > 0) out.append(buf, n);
    }
    return out;
}

int run_memory(const Args & a) {
    const ProcMem before = read_proc_mem(a.model);
    const uint32_t n_ctx = a.n_ctx ? a.n_ctx : 512;
    Shard s;
    std::string err;
    if (!open_shard(s, a.model, a.range_start, a.range_end, a, n_ctx, &err)) {
        std::fprintf(stderr, "dgr-parity: error: %s\n", err.c_str());
        return 2;
    }
    const ProcMem loaded = read_proc_mem(a.model);
    // touch the weights with a short prompt (token ids for a head, random rows otherwise)
    const int32_t n = std::max(8, a.n_random);
    dgr::ShardBatch b;
    if (s.model->is_head()) {
        Args a2 = a;
        a2.n_random = n;
        const auto toks = prompt_tokens(a2, *s.model);
        b.add_tokens(toks.data(), (int32_t) toks.size(), 0, 0, true);
    } else {
        std::mt19937 rng(a.seed);
        std::normal_distribution<float> d(0.0f, 1.0f);
        std::vector<float> rows((size_t) n * s.model->n_embd());
        for (auto & x : rows) x = d(rng);
        b.add_rows(rows.data(), n, s.model->n_embd(), 0, 0, true);
    }
    if (s.ctx->decode(b, &err) != dgr::DecodeStatus::ok) {
        std::fprintf(stderr, "dgr-parity: error: %s\n", err.c_str());
        return 2;
    }
    const ProcMem after = read_proc_mem(a.model);
    // a shard without the token embedding must refuse token ids (boundary input only)
    std::string token_input = "\"accepted\"";
    if (!s.model->is_head()) {
        dgr::ShardBatch tb;
        const llama_token t0 = 1;
        tb.add_tokens(&t0, 1, n, 0, true);
        std::string why;
        const dgr::DecodeStatus st = s.ctx->decode(tb, &why);
        token_input = jstr(dgr::decode_status_name(st));
    }
    std::printf("{\"mode\":\"memory\",\"model\":%s,\"range\":[%d,%d],\"n_layer\":%d,\"head\":%s,\"tail\":%s,"
                "\"n_ctx\":%u,\"mmap\":%s,\"model_buffer_mib_logged\":%s,"
                "\"token_input\":%s,\"before_load\":%s,\"after_load\":%s,\"after_decode\":%s,\"kv\":%s}\n",
                jstr(a.model).c_str(), s.model->layer_start(), s.model->layer_end(), s.model->n_layer(),
                s.model->is_head() ? "true" : "false", s.model->is_tail() ? "true" : "false", n_ctx,
                a.no_mmap ? "false" : "true", jnum(g_model_buf_mib).c_str(), token_input.c_str(),
                mem_json(before).c_str(), mem_json(loaded).c_str(), mem_json(after).c_str(),
                kv_json(s.kv, *s.model).c_str());
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    const Args a = parse_args(argc, argv);
    g_verbose = a.verbose;
    llama_log_set(log_cb, nullptr);
    llama_backend_init();

    int rc = 0;
    if (a.memory) {
        rc = run_memory(a);
        llama_backend_free();
        return rc;
    }

    std::string err;
    // whole model first: its vocabulary gives the prompt and the layer count checks the splits
    std::vector<Shard> whole(1);
    // n_ctx is known only after the prompt: load the model, tokenize, then create the context
    {
        dgr::ShardModelOptions mo;
        mo.path = a.model;
        mo.use_mmap = !a.no_mmap;
        whole[0].model = dgr::ShardModel::load(mo, &err);
        if (!whole[0].model) {
            std::fprintf(stderr, "dgr-parity: error: %s\n", err.c_str());
            return 2;
        }
    }
    const std::vector<llama_token> prompt = prompt_tokens(a, *whole[0].model);
    if (prompt.empty()) {
        std::fprintf(stderr, "dgr-parity: error: empty prompt\n");
        return 2;
    }
    const int32_t n_layer = whole[0].model->n_layer();
    const uint32_t n_ctx = a.n_ctx ? a.n_ctx : (uint32_t) ((a.n_seq * (prompt.size() + a.n_predict) + 63) / 64 * 64);
    {
        dgr::ShardContextOptions co;
        co.n_ctx = n_ctx;
        co.n_batch = n_ctx;
        co.n_ubatch = std::min<uint32_t>(n_ctx, 512);
        co.n_seq_max = (uint32_t) a.n_seq;
        co.kv_unified = a.n_seq > 1 && a.kv_unified;
        co.n_threads = a.n_threads;
        g_kv = {};
        whole[0].ctx = dgr::ShardContext::create(*whole[0].model, co, &err);
        whole[0].kv = g_kv;
        if (!whole[0].ctx) {
            std::fprintf(stderr, "dgr-parity: error: %s\n", err.c_str());
            return 2;
        }
    }
    RunResult ref;
    if (!run_chain(whole, prompt, a.n_seq, a.n_predict, ref, &err)) {
        std::fprintf(stderr, "dgr-parity: error: whole model: %s\n", err.c_str());
        return 2;
    }
    const int32_t n_vocab = whole[0].model->n_vocab();

    std::string out = "{\"model\":" + jstr(a.model) + ",\"n_layer\":" + std::to_string(n_layer) +
        ",\"n_embd\":" + std::to_string(whole[0].model->n_embd()) + ",\"n_vocab\":" + std::to_string(n_vocab) +
        ",\"n_ctx\":" + std::to_string(n_ctx) + ",\"n_prompt\":" + std::to_string(prompt.size()) +
        ",\"n_predict\":" + std::to_string(a.n_predict) + ",\"n_seq\":" + std::to_string(a.n_seq) +
        ",\"tolerance\":" + jnum(a.tolerance) +
        ",\"prompt_tokens\":" + jarr(prompt) +
        ",\"whole\":{\"tokens\":" + jarr(ref.generated[0]) + ",\"text_until_eog\":" +
        jstr(detokenize(*whole[0].model, ref.generated[0])) + ",\"tokens_per_seq\":" + jarr2(ref.generated) + ",\"kv\":" + kv_json(whole[0].kv, *whole[0].model) + "}" +
        ",\"splits\":[";
    whole.clear();  // free the whole model before loading the shards

    bool all_ok = true;
    for (size_t si = 0; si < a.splits.size(); ++si) {
        std::vector<int32_t> ends = a.splits[si];
        if (!ends.empty() && ends.front() == 0) ends.erase(ends.begin());  // "0:15:30" form
        if (ends.empty() || ends.back() != n_layer) ends.push_back(n_layer);
        std::vector<std::pair<int32_t, int32_t>> ranges;
        int32_t start = 0;
        bool bad = false;
        for (int32_t e : ends) {
            if (e <= start || e > n_layer) bad = true;
            ranges.emplace_back(start, e);
            start = e;
        }
        if (bad) {
            std::fprintf(stderr, "dgr-parity: error: split %zu is not increasing within (0, %d]\n", si, n_layer);
            return 2;
        }
        if (!a.slices.empty() && (a.splits.size() != 1 || a.slices.size() != ranges.size())) {
            std::fprintf(stderr, "dgr-parity: error: --slices needs one file per shard of a single --split\n");
            return 2;
        }
        std::vector<Shard> chain(ranges.size());
        std::string roles = "[";
        for (size_t i = 0; i < ranges.size(); ++i) {
            const std::string path = a.slices.empty() ? a.model : a.slices[i];
            if (!open_shard(chain[i], path, ranges[i].first, ranges[i].second, a, n_ctx, &err)) {
                std::fprintf(stderr, "dgr-parity: error: shard [%d, %d): %s\n", ranges[i].first, ranges[i].second,
                             err.c_str());
                return 2;
            }
            const auto & m = *chain[i].model;
            if (m.layer_start() != ranges[i].first || m.layer_end() != ranges[i].second) {
                std::fprintf(stderr, "dgr-parity: error: shard loaded [%d, %d), asked [%d, %d)\n", m.layer_start(),
                             m.layer_end(), ranges[i].first, ranges[i].second);
                return 2;
            }
            roles += std::string(i ? "," : "") + "{\"start\":" + std::to_string(m.layer_start()) + ",\"end\":" +
                std::to_string(m.layer_end()) + ",\"head\":" + (m.is_head() ? "true" : "false") + ",\"tail\":" +
                (m.is_tail() ? "true" : "false") + ",\"file\":" + jstr(path) + ",\"kv\":" + kv_json(chain[i].kv, m) +
                "}";
        }
        roles += "]";
        RunResult got;
        if (!run_chain(chain, prompt, a.n_seq, a.n_predict, got, &err)) {
            std::fprintf(stderr, "dgr-parity: error: split %zu: %s\n", si, err.c_str());
            return 2;
        }
        // prefill: every prompt position of every sequence
        const size_t n_rows = (size_t) a.n_seq * prompt.size();
        double max_diff = 0.0;
        int32_t top1_agree = 0;
        const bool same_size = got.prefill.size() == ref.prefill.size();
        bool identical = same_size;
        for (size_t p = 0; same_size && p < n_rows; ++p) {
            const float * x = ref.prefill.data() + p * n_vocab;
            const float * y = got.prefill.data() + p * n_vocab;
            for (int32_t v = 0; v < n_vocab; ++v) {
                max_diff = std::max(max_diff, (double) std::fabs(x[v] - y[v]));
            }
            identical = identical && std::memcmp(x, y, sizeof(float) * n_vocab) == 0;
            top1_agree += argmax(x, n_vocab) == argmax(y, n_vocab);
        }
        // decode: the first step where any sequence picks another token; before it, the logits
        int32_t first_div = -1;
        for (int32_t sq = 0; sq < a.n_seq; ++sq) {
            const auto & x = ref.generated[sq];
            const auto & y = got.generated[sq];
            for (size_t k = 0; k < x.size(); ++k) {
                if (k >= y.size() || x[k] != y[k]) {
                    first_div = first_div < 0 ? (int32_t) k : std::min(first_div, (int32_t) k);
                    break;
                }
            }
        }
        double decode_max_diff = 0.0;
        const size_t n_cmp = first_div < 0 ? ref.steps.size() : (size_t) first_div;
        for (size_t k = 0; k < n_cmp && k < got.steps.size(); ++k) {
            for (size_t v = 0; v < ref.steps[k].size(); ++v) {
                decode_max_diff = std::max(decode_max_diff, (double) std::fabs(ref.steps[k][v] - got.steps[k][v]));
            }
        }
        const bool tokens_ok = first_div < 0;
        const bool ok = tokens_ok && top1_agree == (int32_t) n_rows && max_diff <= a.tolerance &&
                        decode_max_diff <= a.tolerance;
        all_ok = all_ok && ok;
        std::string rs = "[";
        for (size_t i = 0; i < ranges.size(); ++i) {
            rs += std::string(i ? "," : "") + "[" + std::to_string(ranges[i].first) + "," +
                  std::to_string(ranges[i].second) + "]";
        }
        rs += "]";
        out += std::string(si ? "," : "") + "{\"ranges\":" + rs + ",\"shards\":" + roles +
            ",\"prefill_max_abs_diff\":" + jnum(max_diff) +
            ",\"prefill_top1_agree\":" + std::to_string(top1_agree) +
            ",\"prefill_positions\":" + std::to_string(n_rows) +
            ",\"prefill_bit_identical\":" + (identical ? "true" : "false") +
            ",\"decode_max_abs_diff\":" + jnum(decode_max_diff) +
            ",\"tokens\":" + jarr(got.generated[0]) + ",\"tokens_per_seq\":" + jarr2(got.generated) +
            ",\"tokens_identical\":" + (tokens_ok ? "true" : "false") +
            ",\"first_divergence\":" + std::to_string(first_div) +
            ",\"ok\":" + (ok ? "true" : "false") + "}";
    }
    out += std::string("],\"ok\":") + (all_ok ? "true" : "false") + "}";
    std::printf("%s\n", out.c_str());
    llama_backend_free();
    return all_ok ? 0 : 1;
}
