#include "worker/option_table.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace dgr::worker {

namespace {

bool is_integer_kind(OptionKind k) {
    return k == OptionKind::kU32 || k == OptionKind::kU64 || k == OptionKind::kI32;
}

// A number as the usage and the errors print it: integers without a fraction.
std::string number_text(double v) {
    char buf[64];
    if (v == std::floor(v) && std::fabs(v) < 1e18) {
        std::snprintf(buf, sizeof buf, "%.0f", v);
    } else {
        std::snprintf(buf, sizeof buf, "%.17g", v);
    }
    return buf;
}

void json_string(std::string * out, const char * s) {
    out->push_back('"');
    for (const char * p = s; *p; ++p) {
        const unsigned char c = (unsigned char) *p;
        if (c == '"' || c == '\\') {
            out->push_back('\\');
            out->push_back((char) c);
        } else if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            *out += buf;
        } else {
            out->push_back((char) c);
        }
    }
    out->push_back('"');
}

const char * kind_name(OptionKind k) {
    switch (k) {
        case OptionKind::kFlag: return "flag";
        case OptionKind::kU32: return "u32";
        case OptionKind::kU64: return "u64";
        case OptionKind::kI32: return "i32";
        case OptionKind::kReal: return "real";
        case OptionKind::kText: return "text";
        case OptionKind::kRange: return "range";
    }
    return "?";
}

// "LO (note) .. HI", "at least LO" or "at most HI": the bounds a value was refused for.
std::string bounds_text(const OptionSpec & s) {
    const std::string lo = s.has_min ? number_text(s.min) + (*s.min_note ? std::string(" (") + s.min_note + ")" : "") : "";
    if (s.has_min && s.has_max) return lo + " .. " + number_text(s.max);
    if (s.has_min) return "at least " + lo;
    return "at most " + number_text(s.max);
}

}  // namespace

const OptionSpec * find_option(const std::string & flag) {
    if (flag.size() < 3 || flag.compare(0, 2, "--") != 0) return nullptr;
    for (const OptionSpec & s : kOptionTable) {
        if (flag.compare(2, std::string::npos, s.name) == 0) return &s;
    }
    return nullptr;
}

bool option_bounds(const OptionSpec & s, double * lo, double * hi) {
    if (!is_integer_kind(s.kind) && s.kind != OptionKind::kReal) return false;
    *lo = s.has_min ? s.min : s.kind == OptionKind::kI32 ? -2147483648.0 : 0.0;
    *hi = s.has_max ? s.max
        : s.kind == OptionKind::kU32 ? 4294967295.0
        : s.kind == OptionKind::kI32 ? 2147483647.0
        : HUGE_VAL;  // u64: its width; real: none
    return true;
}

std::string option_default_text(const OptionSpec & s) {
    if (s.shown) return s.shown;
    switch (s.kind) {
        case OptionKind::kFlag:
        case OptionKind::kRange: return "";
        case OptionKind::kText: return s.text;
        default: return number_text(s.value);
    }
}

std::string option_value_text(const OptionSpec & s) {
    switch (s.kind) {
        case OptionKind::kFlag:
        case OptionKind::kRange: return "";
        case OptionKind::kText: return s.text;
        default: return number_text(s.value);
    }
}

bool parse_option_value(const OptionSpec & s, const char * v, OptionValue * out, std::string * err) {
    const std::string flag = std::string("--") + s.name;
    const std::string got = std::string(", got '") + v + "'";
    out->text = v;
    switch (s.kind) {
        case OptionKind::kFlag: out->number = 1; return true;
        case OptionKind::kText: return true;
        case OptionKind::kRange: {
            unsigned a = 0, b = 0;
            char tail = 0;
            const std::string t = v;
            const bool digits = t.find_first_not_of("0123456789:") == std::string::npos &&
                                std::count(t.begin(), t.end(), ':') == 1;
            if (!digits || std::sscanf(v, "%u:%u%c", &a, &b, &tail) != 2 || a >= b) {
                *err = flag + " wants A:B with A < B" + got;
                return false;
            }
            out->start = a;
            out->end = b;
            return true;
        }
        case OptionKind::kReal: {
            char * end = nullptr;
            const double d = std::strtod(v, &end);
            if (!end || end == v || *end || !std::isfinite(d) || d < 0) {
                *err = flag + " wants a non-negative number" + got;
                return false;
            }
            out->number = d;
            break;
        }
        default: {
            char * end = nullptr;
            errno = 0;
            double lo = 0, hi = 0;
            option_bounds(s, &lo, &hi);
            if (lo >= 0) {
                const unsigned long long u = std::strtoull(v, &end, 10);
                if (errno || !end || end == v || *end || v[0] == '-' || v[0] == '+' || v[0] == ' ') {
                    *err = flag + " wants a non-negative integer" + got;
                    return false;
                }
                out->u64 = u;
                out->i64 = (int64_t) std::min<unsigned long long>(u, INT64_MAX);
                out->number = (double) u;
            } else {
                const long long i = std::strtoll(v, &end, 10);
                if (errno || !end || end == v || *end || v[0] == ' ') {
                    *err = flag + " wants an integer" + got;
                    return false;
                }
                out->i64 = i;
                out->number = (double) i;
            }
            if (out->number < lo || out->number > hi) {
                if ((s.has_min && out->number < s.min) || (s.has_max && out->number > s.max)) {
                    *err = flag + " wants " + bounds_text(s) + got;
                } else {
                    *err = flag + " wants at most " + number_text(hi) + got;  // the type's width
                }
                return false;
            }
            return true;
        }
    }
    double lo = 0, hi = 0;
    option_bounds(s, &lo, &hi);
    if (out->number < lo || out->number > hi) {
        *err = flag + " wants " + bounds_text(s) + got;
        return false;
    }
    return true;
}

std::string options_usage(const char * first_line) {
    constexpr size_t kCol = 29, kWidth = 110;
    std::string out = first_line;
    out += "\n";
    for (const OptionSpec & s : kOptionTable) {
        std::string head = std::string("  --") + s.name;
        if (*s.metavar) head += std::string(" ") + s.metavar;
        head += head.size() + 1 < kCol ? std::string(kCol - head.size(), ' ') : std::string("  ");
        std::string help = s.help;
        if (s.has_max || (s.has_min && s.min != 0)) help += "; " + bounds_text(s);
        // wrap the help at word boundaries, continuation lines under the help column; "default X"
        // stays on one line
        std::vector<std::string> words;
        std::istringstream in(help);
        for (std::string word; in >> word;) words.push_back(word);
        const std::string def = option_default_text(s);
        if (!def.empty()) {
            words.back() += ";";
            words.push_back("default " + def);
        }
        size_t col = head.size();
        out += head;
        bool first = true;
        for (const std::string & word : words) {
            if (!first && col + 1 + word.size() > kWidth) {
                out += "\n" + std::string(kCol, ' ');
                col = kCol;
            } else if (!first) {
                out += ' ';
                ++col;
            }
            out += word;
            col += word.size();
            first = false;
        }
        out += "\n";
    }
    return out;
}

std::string options_json() {
    std::string out = "{\"options\": [";
    for (size_t i = 0; i < kOptionCount; ++i) {
        const OptionSpec & s = kOptionTable[i];
        out += i ? ",\n  {" : "\n  {";
        out += "\"name\": ";
        json_string(&out, s.name);
        out += ", \"flag\": ";
        json_string(&out, (std::string("--") + s.name).c_str());
        out += ", \"kind\": ";
        json_string(&out, kind_name(s.kind));
        out += ", \"metavar\": ";
        json_string(&out, s.metavar);
        out += ", \"default\": ";
        if (s.kind == OptionKind::kFlag) {
            out += "false";
        } else if (s.kind == OptionKind::kRange) {
            out += "null";
        } else if (s.kind == OptionKind::kText) {
            json_string(&out, s.text);
        } else {
            out += number_text(s.value);
        }
        double lo = 0, hi = 0;
        const bool numeric = option_bounds(s, &lo, &hi);
        out += ", \"min\": " + (numeric ? number_text(lo) : std::string("null"));
        out += ", \"max\": " + (numeric && std::isfinite(hi) ? number_text(hi) : std::string("null"));
        out += ", \"default_text\": ";
        json_string(&out, option_default_text(s).c_str());
        out += ", \"help\": ";
        json_string(&out, s.help);
        out += "}";
    }
    out += "\n]}\n";
    return out;
}

std::vector<std::string> split_peer_list(const std::string & list) {
    std::vector<std::string> out;
    std::stringstream ss(list);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (item.size() > 1 && item.front() == '[' && item.back() == ']') item = item.substr(1, item.size() - 2);
        for (auto & c : item) c = (char) std::tolower((unsigned char) c);
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

int options_main(int argc, char ** argv) {
    bool json = false;
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--json") {
            json = true;
        } else if (a == "--help" || a == "-h") {
            std::printf("usage: dgr-worker options [--json]\n"
                        "  the options of `serve` and `plan-memory`: flag, default, bounds and help, from the\n"
                        "  worker's one table of them (worker/option_table.h); --json: as one JSON object\n");
            return 0;
        } else {
            std::fprintf(stderr, "dgr-worker: error: unknown options argument '%s'\n", a.c_str());
            return 2;
        }
    }
    const std::string text = json ? options_json() : options_usage("dgr-worker serve options:");
    std::fputs(text.c_str(), stdout);
    return 0;
}

}  // namespace dgr::worker
