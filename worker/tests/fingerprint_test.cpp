// CTest: the C++ SHA-256 and recipe fingerprint agree with Python on the shared vectors in
// tests/vectors/fingerprint/ (written by `python -m dgr.recipe write-vectors`).
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/fingerprint.h"
#include "common/sha256.h"

#ifndef DGR_REPO_ROOT
#define DGR_REPO_ROOT "."
#endif

#include "check.h"

static std::string unescape(const std::string & s) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '\\' && i + 1 < s.size()) {
            out += s[i + 1] == 'n' ? '\n' : s[i + 1];
            ++i;
        } else {
            out += s[i];
        }
    }
    return out;
}

static bool read_lines(const std::string & path, std::vector<std::string> * lines) {
    std::ifstream in(path);
    if (!in) return false;
    std::string line;
    while (std::getline(in, line)) lines->push_back(line);
    return true;
}

static void test_sha256_known() {
    CHECK(dgr::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "empty");
    CHECK(dgr::sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", "abc");
    dgr::Sha256 h;  // streaming in odd pieces equals one shot
    std::string msg(1000, 'x');
    for (size_t i = 0; i < msg.size(); i += 7) h.update(msg.data() + i, msg.size() - i < 7 ? msg.size() - i : 7);
    auto d = h.finish();
    CHECK(dgr::to_hex(d.data(), d.size()) == dgr::sha256_hex(msg), "streaming");
}

static void test_sha256_vectors() {
    std::vector<std::string> lines;
    const std::string path = std::string(DGR_REPO_ROOT) + "/tests/vectors/fingerprint/sha256.txt";
    CHECK(read_lines(path, &lines), "cannot read %s", path.c_str());
    int n = 0;
    for (const auto & line : lines) {
        if (line.empty() || line[0] == '#') continue;
        const size_t sp = line.find(' ');
        const size_t len = std::stoul(line.substr(0, sp));
        std::string msg(len, '\0');
        for (size_t i = 0; i < len; ++i) msg[i] = char((i * 7 + 3) & 0xff);
        CHECK(dgr::sha256_hex(msg) == line.substr(sp + 1), "sha256 of %zu bytes", len);
        ++n;
    }
    CHECK(n >= 10, "expected sha256 vectors, found %d", n);
}

static void test_fingerprint_vectors() {
    std::vector<std::string> lines;
    const std::string path = std::string(DGR_REPO_ROOT) + "/tests/vectors/fingerprint/recipes.txt";
    CHECK(read_lines(path, &lines), "cannot read %s", path.c_str());
    std::map<std::string, std::string> cur;
    int cases = 0, errors = 0;
    std::string baseline_fp;
    for (const auto & line : lines) {
        if (line.empty() || line[0] == '#') continue;
        if (line.rfind("case=", 0) == 0) {
            cur.clear();
            cur["case"] = line.substr(5);
            continue;
        }
        if (line != "end") {
            const size_t eq = line.find('=');
            cur[line.substr(0, eq)] = unescape(line.substr(eq + 1));
            continue;
        }
        const std::string name = cur["case"];
        dgr::RecipeFingerprintFields f;
        bool set_ok = true;
        for (const auto & [k, v] : cur) {
            if (k == "case" || k == "fingerprint" || k == "expect") continue;
            set_ok = dgr::set_fingerprint_field(&f, k, v) && set_ok;
        }
        std::string fp, err;
        const bool ok = set_ok && dgr::recipe_fingerprint(f, &fp, &err);
        if (cur.count("expect") && cur["expect"] == "error") {
            CHECK(!ok, "case %s: expected an error, got fingerprint %s", name.c_str(), fp.c_str());
            ++errors;
        } else {
            CHECK(ok, "case %s: unexpected error: %s", name.c_str(), err.c_str());
            CHECK(fp == cur["fingerprint"], "case %s: fingerprint %s, want %s", name.c_str(), fp.c_str(),
                  cur["fingerprint"].c_str());
            if (name == "baseline") baseline_fp = fp;
            if (name == "outside_fields_same_fp") CHECK(fp == baseline_fp, "fields outside must not change the fingerprint");
            else if (name != "baseline") CHECK(fp != baseline_fp, "case %s must differ from baseline", name.c_str());
        }
        ++cases;
    }
    CHECK(cases >= 10 && errors >= 3, "expected vectors, found %d cases (%d error cases)", cases, errors);
}

int main() {
    test_sha256_known();
    test_sha256_vectors();
    test_fingerprint_vectors();
    if (g_failures) {
        std::fprintf(stderr, "fingerprint_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("fingerprint_test: ok\n");
    return 0;
}
