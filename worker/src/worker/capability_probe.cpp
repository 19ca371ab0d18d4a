// Measured capability (capability_probe.h).
#include "worker/capability_probe.h"

#include "nlohmann/json.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace dgr::worker {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// rows of `seqs` sequences starting at position 0, `per_seq` consecutive positions each
DecodeBatch make_batch(const BackendInfo & in, uint32_t seqs, uint32_t per_seq, bool outputs) {
    DecodeBatch b;
    for (uint32_t s = 0; s < seqs; ++s) {
        for (uint32_t p = 0; p < per_seq; ++p) {
            if (in.head) {
                b.tokens.push_back(1 + (int32_t) ((s + p) % 2));
            } else {
                for (uint32_t j = 0; j < in.n_embd; ++j) {
                    b.embd.push_back(0.02f * std::sin(0.37f * (float) (j + 7 * p + 13 * s)));
                }
            }
            b.pos.push_back((int32_t) p);
            b.seq.push_back((int32_t) s);
            // a tail asks for a logits row per decode row, and for the last row of a prompt
            b.output.push_back(in.tail && outputs && p + 1 == per_seq ? 1 : 0);
        }
    }
    return b;
}

// median seconds of `repeats` calls after one warm-up; every sequence cleared after each call
bool time_batch(ModelBackend & be, const DecodeBatch & b, uint32_t seqs, uint32_t repeats, double * out,
                std::string * error) {
    std::vector<double> t;
    for (uint32_t r = 0; r <= repeats; ++r) {
        const auto t0 = Clock::now();
        const BackendStatus st = be.decode(b, error);
        const double s = since(t0);
        for (uint32_t q = 0; q < seqs; ++q) be.seq_rm((int32_t) q, 0, -1);
        if (st != BackendStatus::ok) {
            if (error->empty()) *error = "decode failed";
            return false;
        }
        if (r > 0) t.push_back(s);  // the first call warms caches and threads
    }
    std::sort(t.begin(), t.end());
    *out = t[t.size() / 2];
    return true;
}

}  // namespace

ProbeResult probe_capability(ModelBackend & be, const ProbeOptions & o) {
    const BackendInfo & in = be.info();
    ProbeResult r;
    r.layers = in.layer_end - in.layer_start;
    r.head = in.head;
    r.tail = in.tail;
    const auto t0 = Clock::now();
    const uint32_t repeats = std::max<uint32_t>(1, o.repeats);
    const uint32_t max_rows = std::min(in.max_batch_tokens, std::min(in.n_seq_max, in.kv_cells));
    std::vector<uint32_t> sizes = o.batch_rows;
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    uint32_t last_rows = 0;
    double last_s = 0.0;  // the largest size measured, to estimate the next
    auto run = [&](uint32_t seqs, uint32_t per_seq, bool outputs, double * out) {
        return time_batch(be, make_batch(in, seqs, per_seq, outputs), seqs, repeats, out, &r.error);
    };
    // a prompt piece, right after the first decode size (it is needed however small the budget:
    // the piece halves until its estimate fits what is left, down to 4 rows)
    auto prompt_probe = [&]() {
        // one sequence's share of the cells (one KV stream per sequence unless --kv-unified)
        const uint32_t per_seq = in.kv_cells / std::max<uint32_t>(1, in.n_seq_max);
        uint32_t prompt = std::min(o.prompt_rows, std::min(in.max_batch_tokens, per_seq));
        const double calls = (double) (repeats + 1) * (in.tail ? 2.0 : 1.0);
        while (prompt > 4 && since(t0) + calls * last_s * (double) prompt / last_rows > o.budget_s) prompt /= 2;
        if (prompt == 0) return;
        double s = 0.0;
        if (!run(1, prompt, true, &s)) return;
        r.prompt_s_per_token = s / prompt;
        double n = 0.0;
        if (in.tail && run(1, prompt, false, &n)) r.prompt_no_output_s_per_token = n / prompt;
    };
    // the first size's steps back to back for the window (at least 3 calls): their mean
    auto sustained_probe = [&](uint32_t rows, double burst) {
        const DecodeBatch b = make_batch(in, rows, 1, true);
        const auto w0 = Clock::now();
        uint32_t calls = 0;
        const double window = std::min(o.sustained_window_s, std::max(0.0, 0.5 * (o.budget_s - since(t0))));
        while (calls < 3 || since(w0) < window) {
            const BackendStatus st = be.decode(b, &r.error);
            for (uint32_t q = 0; q < rows; ++q) be.seq_rm((int32_t) q, 0, -1);
            if (st != BackendStatus::ok) {
                if (r.error.empty()) r.error = "decode failed";
                return;
            }
            ++calls;
        }
        r.sustained_s = since(w0) / calls;
        r.duty = r.sustained_s > 0.0 ? std::min(1.0, burst / r.sustained_s) : 1.0;
    };
    for (uint32_t rows : sizes) {
        if (rows == 0) continue;
        const double calls = (double) (repeats + 1) * (in.tail ? 2.0 : 1.0);
        const double estimate = last_rows ? calls * last_s * (double) rows / (double) last_rows : 0.0;
        if (rows > max_rows || (last_rows && since(t0) + estimate > o.budget_s)) {
            r.skipped.push_back(rows);
            continue;
        }
        double s = 0.0;
        if (!run(rows, 1, true, &s)) break;
        r.decode_s[rows] = s;
        if (in.tail) {
            double n = 0.0;
            if (!run(rows, 1, false, &n)) break;
            r.decode_no_output_s[rows] = n;
        }
        const bool first = last_rows == 0;
        last_rows = rows;
        last_s = s;
        if (first) {
            sustained_probe(rows, s);
            if (!r.ok()) break;
            prompt_probe();
            if (!r.ok()) break;
        }
    }
    r.seconds = since(t0);
    return r;
}

std::string probe_json(const ProbeResult & r) {
    auto num = [](double v) {
        char b[64];
        std::snprintf(b, sizeof b, "%.17g", std::isfinite(v) ? v : 0.0);  // round-trips (the cache)
        return std::string(b);
    };
    auto table = [&](const std::map<uint32_t, double> & m) {
        std::string s = "{";
        for (const auto & [k, v] : m) s += (s.size() > 1 ? ", \"" : "\"") + std::to_string(k) + "\": " + num(v);
        return s + "}";
    };
    std::string skipped = "[";
    for (uint32_t k : r.skipped) skipped += (skipped.size() > 1 ? ", " : "") + std::to_string(k);
    skipped += "]";
    std::string err;
    for (char c : r.error) {
        if (c == '"' || c == '\\') err += '\\';
        if ((unsigned char) c >= 0x20) err += c;
    }
    return "{\"layers\": " + std::to_string(r.layers) + ", \"head\": " + (r.head ? "true" : "false") +
           ", \"tail\": " + (r.tail ? "true" : "false") + ", \"decode_s\": " + table(r.decode_s) +
           ", \"decode_no_output_s\": " + table(r.decode_no_output_s) +
           ", \"prompt_s_per_token\": " + num(r.prompt_s_per_token) +
           ", \"prompt_no_output_s_per_token\": " + num(r.prompt_no_output_s_per_token) +
           ", \"sustained_s\": " + num(r.sustained_s) + ", \"duty\": " + num(r.duty) + ", \"skipped\": " + skipped +
           ", \"seconds\": " + num(r.seconds) + ", \"error\": \"" + err + "\"}";
}

MeasuredCost measured_cost(const ProbeResult & r, uint32_t threads, bool from_cache) {
    MeasuredCost m;
    m.present = true;
    m.from_cache = from_cache;
    for (const auto & [rows, s] : r.decode_s) {
        const auto it = r.decode_no_output_s.find(rows);
        m.decode.push_back({rows, s, it == r.decode_no_output_s.end() ? 0.0 : it->second});
    }
    m.prompt_s_per_token = r.prompt_s_per_token;
    m.prompt_no_output_s_per_token = r.prompt_no_output_s_per_token;
    m.duty = r.duty;
    m.threads = threads;
    m.probe_seconds = r.seconds;
    return m;
}

std::string probe_cache_path(const BackendInfo & in, const std::string & backend, uint32_t threads) {
    if (in.artifact_id.empty()) return "";
    for (char c : in.artifact_id) {
        if (!std::isxdigit((unsigned char) c)) return "";  // it names a file: hex only
    }
    std::filesystem::path dir;
    if (const char * d = std::getenv("DGR_PROBE_CACHE_DIR"); d && *d) {
        dir = d;
    } else if (const char * x = std::getenv("XDG_CACHE_HOME"); x && *x) {
        dir = std::filesystem::path(x) / "dgr" / "probe";
    } else if (const char * h = std::getenv("HOME"); h && *h) {
        dir = std::filesystem::path(h) / ".cache" / "dgr" / "probe";
    } else {
        return "";
    }
    std::string be;
    for (char c : backend) be += std::isalnum((unsigned char) c) ? c : '_';
    return (dir / (in.artifact_id + "-" + std::to_string(in.layer_start) + "_" + std::to_string(in.layer_end) + "-" +
                   be + "-t" + std::to_string(threads) + ".json"))
        .string();
}

bool load_cached_probe(const std::string & path, const BackendInfo & in, ProbeResult * out) {
    if (path.empty()) return false;
    std::ifstream f(path);
    if (!f) return false;
    std::stringstream ss;
    ss << f.rdbuf();
    try {
        const auto j = nlohmann::json::parse(ss.str());
        ProbeResult r;
        r.layers = j.at("layers").get<uint32_t>();
        r.head = j.at("head").get<bool>();
        r.tail = j.at("tail").get<bool>();
        if (r.layers != in.layer_end - in.layer_start || r.head != in.head || r.tail != in.tail) return false;
        for (const auto & [k, v] : j.at("decode_s").items()) r.decode_s[(uint32_t) std::stoul(k)] = v.get<double>();
        for (const auto & [k, v] : j.at("decode_no_output_s").items()) {
            r.decode_no_output_s[(uint32_t) std::stoul(k)] = v.get<double>();
        }
        r.prompt_s_per_token = j.at("prompt_s_per_token").get<double>();
        r.prompt_no_output_s_per_token = j.at("prompt_no_output_s_per_token").get<double>();
        r.sustained_s = j.at("sustained_s").get<double>();
        r.duty = j.at("duty").get<double>();
        r.seconds = j.at("seconds").get<double>();
        r.error = j.at("error").get<std::string>();
        for (const auto & [rows, s] : r.decode_s) {
            if (!(std::isfinite(s) && s > 0.0) || rows == 0) return false;
        }
        if (!r.ok() || r.decode_s.empty() || !(r.duty > 0.0 && r.duty <= 1.0)) return false;
        *out = r;
        return true;
    } catch (const std::exception &) {
        return false;  // a damaged cache file is measured again
    }
}

bool save_probe(const std::string & path, const ProbeResult & r) {
    if (path.empty() || !r.ok()) return false;
    std::error_code ec;
    const std::filesystem::path p(path);
    std::filesystem::create_directories(p.parent_path(), ec);
    const std::filesystem::path tmp = p.string() + ".tmp";
    {
        std::ofstream f(tmp, std::ios::trunc);
        if (!f) return false;
        f << probe_json(r) << "\n";
        if (!f) return false;
    }
    std::filesystem::rename(tmp, p, ec);
    return !ec;
}

}  // namespace dgr::worker
