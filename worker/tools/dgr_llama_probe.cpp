// dgr-llama-probe: a small whole-model llama.cpp program for the DGR-001 baseline.
//
// It reads token ids (tokenized once by the caller, so every recipe sees identical ids) and
// runs jobs against one model with greedy decoding, printing one JSON object per job:
//   gen N id...      prefill the prompt (logits for every prompt position are appended as raw
//                    float32 rows to --logits-out), then N greedy tokens; reports the ids,
//                    time to first token and per-token decode latencies.
//   run N id...      the same without saving logits (timing runs, warm-up).
//   score C id...    log-likelihood of the ids in non-overlapping chunks of C tokens (every
//                    position but the first of a chunk is scored); reports the summed NLL and
//                    the top-1 id predicted at each scored position.
// Built by `dgr bench baseline` against the pinned llama.cpp static libraries.
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static int argmax(const float * v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        if (v[i] > v[best]) best = i;
    }
    return best;
}

// Decode `ids` starting at position `pos0` in sequence 0; logits requested for every row when
// `all_logits`, otherwise only for the last. Returns llama_decode's code.
static int decode(llama_context * ctx, llama_batch & batch, const std::vector<llama_token> & ids,
                  int pos0, bool all_logits) {
    batch.n_tokens = 0;
    for (size_t i = 0; i < ids.size(); i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = pos0 + (int) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = all_logits || i + 1 == ids.size();
        batch.n_tokens++;
    }
    return llama_decode(ctx, batch);
}

int main(int argc, char ** argv) {
    std::string model_path, jobs_path, logits_path;
    int threads = 2, n_ctx = 512, ngl = 0;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) { fprintf(stderr, "%s: error: %s needs a value\n", __func__, a.c_str()); exit(2); }
            return argv[++i];
        };
        if (a == "-m") model_path = next();
        else if (a == "-t") threads = std::stoi(next());
        else if (a == "-c") n_ctx = std::stoi(next());
        else if (a == "-ngl") ngl = std::stoi(next());
        else if (a == "--jobs") jobs_path = next();
        else if (a == "--logits-out") logits_path = next();
        else { fprintf(stderr, "usage: %s -m MODEL --jobs FILE [--logits-out FILE] [-t N] [-c N] [-ngl N]\n", argv[0]); return 2; }
    }
    if (model_path.empty() || jobs_path.empty()) {
        fprintf(stderr, "%s: error: -m and --jobs are required\n", __func__);
        return 2;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = ngl;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (!model) { fprintf(stderr, "%s: error: cannot load %s\n", __func__, model_path.c_str()); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = n_ctx;
    cparams.n_batch = n_ctx;
    cparams.n_ubatch = n_ctx;
    cparams.n_seq_max = 1;
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    cparams.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) { fprintf(stderr, "%s: error: cannot create a context\n", __func__); llama_model_free(model); return 1; }
    llama_batch batch = llama_batch_init(n_ctx, 0, 1);

    std::ofstream logits_out;
    if (!logits_path.empty()) logits_out.open(logits_path, std::ios::binary);
    std::ifstream jobs(jobs_path);
    std::string line;
    int rc = 0;
    int job = 0;
    while (rc == 0 && std::getline(jobs, line)) {
        std::istringstream in(line);
        std::string kind;
        int arg = 0;
        if (!(in >> kind >> arg)) continue;
        std::vector<llama_token> ids;
        for (llama_token t; in >> t;) ids.push_back(t);
        llama_memory_clear(llama_get_memory(ctx), true);
        if (ids.empty() || (kind != "score" && (int) ids.size() > n_ctx)) {
            fprintf(stderr, "%s: error: job %d has %zu tokens (context %d)\n", __func__, job, ids.size(), n_ctx);
            rc = 1;
            break;
        }
        if (kind == "gen" || kind == "run") {
            const bool save = kind == "gen";
            if ((int) ids.size() + arg > n_ctx) { fprintf(stderr, "%s: error: job %d exceeds the context\n", __func__, job); rc = 1; break; }
            const double t0 = now_s();
            int code = decode(ctx, batch, ids, 0, true);
            if (code != 0) { fprintf(stderr, "%s: error: llama_decode returned %d\n", __func__, code); rc = 1; break; }
            int tok = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
            const double ttft = now_s() - t0;
            if (save && logits_out.is_open()) {
                for (size_t i = 0; i < ids.size(); i++) {
                    logits_out.write(reinterpret_cast<const char *>(llama_get_logits_ith(ctx, (int) i)), sizeof(float) * n_vocab);
                }
            }
            std::vector<int> out{tok};
            std::vector<double> lat;
            int pos = (int) ids.size();
            for (int s = 1; s < arg; s++) {
                const double t1 = now_s();
                code = decode(ctx, batch, {(llama_token) tok}, pos++, false);
                if (code != 0) { fprintf(stderr, "%s: error: llama_decode returned %d\n", __func__, code); rc = 1; break; }
                tok = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
                lat.push_back(now_s() - t1);
                out.push_back(tok);
            }
            printf("{\"job\": %d, \"kind\": \"%s\", \"n_prompt\": %zu, \"ttft_s\": %.6f, \"tokens\": [", job, kind.c_str(), ids.size(), ttft);
            for (size_t i = 0; i < out.size(); i++) printf("%s%d", i ? ", " : "", out[i]);
            printf("], \"token_latency_s\": [");
            for (size_t i = 0; i < lat.size(); i++) printf("%s%.6f", i ? ", " : "", lat[i]);
            printf("]}\n");
        } else if (kind == "score") {
            const int chunk = std::max(2, std::min(arg, n_ctx));
            double nll = 0.0;
            long n_scored = 0;
            std::vector<int> top1;
            for (size_t start = 0; start + 1 < ids.size(); start += chunk) {
                std::vector<llama_token> part(ids.begin() + start, ids.begin() + std::min(ids.size(), start + chunk));
                if (part.size() < 2) break;
                llama_memory_clear(llama_get_memory(ctx), true);
                int code = decode(ctx, batch, part, 0, true);
                if (code != 0) { fprintf(stderr, "%s: error: llama_decode returned %d\n", __func__, code); rc = 1; break; }
                for (size_t i = 0; i + 1 < part.size(); i++) {
                    const float * lg = llama_get_logits_ith(ctx, (int) i);
                    float mx = lg[0];
                    for (int v = 1; v < n_vocab; v++) mx = std::max(mx, lg[v]);
                    double sum = 0.0;
                    for (int v = 0; v < n_vocab; v++) sum += std::exp((double) lg[v] - mx);
                    nll += -((double) lg[part[i + 1]] - mx - std::log(sum));
                    n_scored++;
                    top1.push_back(argmax(lg, n_vocab));
                }
            }
            if (rc != 0) break;
            printf("{\"job\": %d, \"kind\": \"score\", \"nll_sum\": %.9f, \"n_scored\": %ld, \"top1\": [", job, nll, n_scored);
            for (size_t i = 0; i < top1.size(); i++) printf("%s%d", i ? ", " : "", top1[i]);
            printf("]}\n");
        } else {
            fprintf(stderr, "%s: error: unknown job kind %s\n", __func__, kind.c_str());
            rc = 1;
        }
        fflush(stdout);
        job++;
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return rc;
}
