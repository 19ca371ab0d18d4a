#include "worker/device_class.h"

#include <cctype>
#include <sstream>

namespace dgr::worker {

namespace {

std::string lower(const std::string & s) {
    std::string out = s;
    for (char & c : out) c = (char) std::tolower((unsigned char) c);
    return out;
}

bool alnum(char c) { return std::isalnum((unsigned char) c) != 0; }

// `word` in `text` (both lower case) with no letter or digit on either side
bool has_word(const std::string & text, const std::string & word) {
    for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
        const bool left = at == 0 || !alnum(text[at - 1]);
        const bool right = at + word.size() >= text.size() || !alnum(text[at + word.size()]);
        if (left && right) return true;
    }
    return false;
}

// the architecture as a class part: lower case, [a-z0-9_.] kept, anything else a hyphen
std::string arch_part(const std::string & arch) {
    std::string out;
    for (char c : lower(arch)) {
        out.push_back(alnum(c) || c == '_' || c == '.' ? c : '-');
        if (out.size() >= kSlugMax) break;
    }
    return out;
}

}  // namespace

std::string device_slug(const std::string & text, size_t max) {
    std::string out;
    bool gap = false;
    for (char c : lower(text)) {
        if (!alnum(c)) {
            gap = !out.empty();
            continue;
        }
        if (gap) {
            if (out.size() + 2 > max) break;
            out.push_back('-');
            gap = false;
        }
        if (out.size() + 1 > max) break;
        out.push_back(c);
    }
    while (!out.empty() && out.back() == '-') out.pop_back();
    return out;
}

std::string device_vendor(const std::string & backend, const std::string & description, const std::string & name) {
    const std::string t = lower(description + " " + name);
    if (t.find("llvmpipe") != std::string::npos || t.find("lavapipe") != std::string::npos) return "mesa";
    for (const char * w : {"nvidia", "geforce", "quadro", "tesla"}) {
        if (has_word(t, w)) return "nvidia";
    }
    for (const char * w : {"amd", "radeon", "instinct"}) {
        if (has_word(t, w)) return "amd";
    }
    if (t.find("intel") != std::string::npos) return "intel";
    const std::string b = lower(backend);
    if (b == "cuda") return "nvidia";
    if (b == "hip" || b == "rocm") return "amd";
    return "";
}

std::string device_class_of(const ComputeDevice & d) {
    std::string backend = device_slug(d.backend, 16);
    if (backend.empty()) backend = "unknown";
    if (backend == "cpu") return "cpu";
    const std::string arch = arch_part(d.architecture);
    if ((backend == "cuda" || backend == "hip") && !arch.empty()) return backend + ":" + arch;
    if (d.vendor == "mesa") return backend + ":llvmpipe";
    if (backend != "cuda" && backend != "hip" && (d.vendor == "nvidia" || d.vendor == "amd" || d.vendor == "intel")) {
        return backend + ":" + d.vendor;
    }
    std::string slug = device_slug(d.description);
    if (slug.empty()) slug = device_slug(d.name);
    return backend + ":" + (slug.empty() ? "unknown" : slug);
}

bool valid_device_class(const std::string & cls) {
    if (cls.empty() || cls.size() > kClassMax) return false;
    for (char c : cls) {
        const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == ':' || c == '_' || c == '.' || c == '-';
        if (!ok) return false;
    }
    return true;
}

bool parse_device_arch_line(const std::string & line, int * index, std::string * arch) {
    const size_t at = line.find("Device ");
    if (at == std::string::npos) return false;
    size_t p = at + 7;
    if (p >= line.size() || !std::isdigit((unsigned char) line[p])) return false;
    int idx = 0;
    while (p < line.size() && std::isdigit((unsigned char) line[p]) && idx < 1000000) idx = idx * 10 + (line[p++] - '0');
    if (p >= line.size() || line[p] != ':') return false;
    const std::string rest = line.substr(p + 1);
    const std::string cc = "compute capability ";
    if (const size_t c = rest.find(cc); c != std::string::npos) {
        size_t q = c + cc.size();
        std::string major, minor;
        while (q < rest.size() && std::isdigit((unsigned char) rest[q]) && major.size() < 3) major.push_back(rest[q++]);
        if (major.empty() || q >= rest.size() || rest[q] != '.') return false;
        ++q;
        while (q < rest.size() && std::isdigit((unsigned char) rest[q]) && minor.size() < 3) minor.push_back(rest[q++]);
        if (minor.empty()) return false;
        *index = idx;
        *arch = "sm_" + major + minor;
        return true;
    }
    if (const size_t g = rest.find(", gfx"); g != std::string::npos) {
        std::string name = "gfx";
        for (size_t q = g + 5; q < rest.size() && std::isalnum((unsigned char) rest[q]) && name.size() < 16; ++q) {
            name.push_back((char) std::tolower((unsigned char) rest[q]));
        }
        if (name.size() == 3) return false;
        *index = idx;
        *arch = name;
        return true;
    }
    return false;
}

std::string parse_nvidia_driver_version(const std::string & text) {
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("NVRM", 0) != 0) continue;
        std::istringstream words(line);
        for (std::string w; words >> w;) {
            bool digits_dots = std::isdigit((unsigned char) w[0]) != 0;
            size_t dots = 0;
            for (char c : w) {
                if (c == '.') {
                    ++dots;
                } else if (!std::isdigit((unsigned char) c)) {
                    digits_dots = false;
                }
            }
            if (digits_dots && dots > 0 && w.back() != '.' && w.size() <= 32) return w;
        }
    }
    return "";
}

}  // namespace dgr::worker
