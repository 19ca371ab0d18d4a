// The named-tensor bundle crossing an Activation Seam (dgr.shard.v1.TensorBundle) and the
// stateless checks of a SessionRequest frame: the one validator, assembler and writer of the
// worker (the scheduler runs these; tests/vectors and worker/tests certify them). Same rules
// as Python dgr.bundle; the rules are written down in proto/dgr/shard/v1/shard_runtime.proto
// (NamedTensor, FrameHeader). Also the one ErrorReason -> gRPC code map.
#pragma once

#include "dgr/shard/v1/shard_runtime.pb.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dgr::bundle {

namespace pb = ::dgr::shard::v1;

// Fragment size writers use unless the peer advertises a smaller max_fragment_bytes.
constexpr size_t kDefaultFragmentBytes = size_t(1) << 20;
// Most dimensions a tensor may have.
constexpr int kMaxDims = 8;
// Longest session id (FrameHeader.session_id: "at most 128 bytes").
constexpr size_t kMaxSessionIdBytes = 128;
// Longest request id (FrameHeader.request_id, FastDecodeFrame.request_id: "at most 128 bytes").
constexpr size_t kMaxRequestIdBytes = 128;
// Most SamplingParams.top_logprobs a worker returns per token.
constexpr uint32_t kMaxTopLogprobs = 64;
// Most SamplingParams.stop_token_ids.
constexpr int kMaxStopTokens = 64;
// SamplingParams.logit_bias: entries at most, and the bias bound (OpenAI's)
constexpr int kMaxLogitBias = 1024;
constexpr float kMaxBias = 100.0f;
// SamplingParams penalties: the window's length at most, and the bounds of each penalty
constexpr uint32_t kMaxPenaltyLastN = 4096;
constexpr float kMaxRepeatPenalty = 10.0f;
constexpr float kMaxFrequencyPenalty = 2.0f;  // frequency_penalty and presence_penalty in [-2, 2]
// SamplingParams.grammar / json_schema: bytes at most
constexpr size_t kMaxGrammarBytes = 65536;
// The boundary bundle's one tensor in schema v1.
inline constexpr const char * kResidual = "residual";
// Schema versions accepted without a capability: [min, max].
constexpr pb::SchemaVersion kMinSchema = pb::SCHEMA_VERSION_V1;
constexpr pb::SchemaVersion kMaxSchema = pb::SCHEMA_VERSION_V1;

// The numeric gRPC status code an ErrorReason maps to (UNKNOWN = 2 for unknown reasons).
int grpc_code_for(pb::ErrorReason reason);

// A frame or bundle broke the protocol.
struct ProtocolError {
    pb::ErrorReason reason = pb::ERROR_REASON_UNSPECIFIED;
    std::string     message;
    std::string     tensor; // empty when not about one tensor
    uint64_t        limit = 0;

    int         grpc_code() const { return grpc_code_for(reason); }
    std::string reason_name() const;
    // "ERROR_REASON_X: message (tensor 'name')"
    std::string to_string() const;
    // The ShardError (message: "message (tensor 'name')"; the reason is its own field).
    pb::ShardError to_message(bool session_terminated = false) const;
};

using Result = std::optional<ProtocolError>; // nullopt = ok

ProtocolError protocol_error(pb::ErrorReason reason, std::string message, std::string tensor = {}, uint64_t limit = 0);

// Element size of a wire dtype; 0 when unknown.
size_t dtype_size(int dtype);

// A reassembled tensor; data in the host's native byte order.
struct Tensor {
    std::string           name;
    std::vector<uint64_t> shape;
    pb::TensorDtype       dtype = pb::TENSOR_DTYPE_UNSPECIFIED;
    std::vector<uint8_t>  data;
};

// 0 = no limit.
struct Limits {
    uint64_t max_tensor_bytes   = 0;
    uint64_t max_fragment_bytes = 0;
};

// Collects the bundle(s) of one step (one or several frames), validating as they arrive.
class Assembler {
  public:
    explicit Assembler(Limits limits = {}, int compression = pb::COMPRESSION_UNSPECIFIED);

    // Take one frame's bundle; the first violation is returned (and the assembler should be
    // dropped). Fragments may arrive in any order, across any number of frames.
    Result add(const pb::TensorBundle & bundle);
    // Only this one tensor may arrive (every frame's bundle carries exactly it, with this dtype
    // and shape): a boundary bundle of `rows` x n_embd is refused at its first frame.
    void expect_only(std::string name, pb::TensorDtype dtype, std::vector<uint64_t> shape);
    // Every fragment of every tensor seen so far has arrived (and at least one tensor).
    bool complete() const;
    // Missing fragment indices per incomplete tensor.
    std::map<std::string, std::vector<uint32_t>> missing() const;
    // Reassemble and verify length + checksum; tensors in arrival order of names.
    Result finish(std::vector<Tensor> * out);

  private:
    struct Pending {
        pb::NamedTensor                 meta; // without fragments
        std::map<uint32_t, std::string> parts;
        uint64_t                        received = 0;
    };
    Result check_meta(const pb::NamedTensor & t) const;

    Limits               limits_;
    bool                 expect_ = false;
    Tensor               expected_;  // name, dtype, shape (no data)
    int                  compression_;
    std::vector<Pending> tensors_;
};

// Validate and reassemble one complete bundle.
Result read_bundle(const pb::TensorBundle & bundle, std::vector<Tensor> * out, Limits limits = {},
                   int compression = pb::COMPRESSION_UNSPECIFIED);
// The v1 boundary bundle -> residual rows [n_tokens * n_embd] f32, checking it is exactly that.
Result read_boundary(const pb::TensorBundle & bundle, uint32_t n_tokens, uint32_t n_embd,
                     std::vector<float> * out, Limits limits = {});

// One tensor (native-order bytes) -> NamedTensor, little-endian, CRC-32, bounded fragments.
void write_tensor(pb::NamedTensor * out, const std::string & name, const std::vector<uint64_t> & shape,
                  pb::TensorDtype dtype, const void * data, size_t size,
                  size_t fragment_bytes = kDefaultFragmentBytes);
// The v1 boundary bundle: "residual" [n_tokens, n_embd] f32.
pb::TensorBundle boundary_bundle(const float * rows, uint32_t n_tokens, uint32_t n_embd,
                                 size_t fragment_bytes = kDefaultFragmentBytes);

// FrameHeader.payload_checksum values: token ids as 4-byte little-endian; a bundle's fragment
// data in the order listed; CRC of nothing = 0.
uint32_t tokens_payload_crc(const pb::TokenSpan & tokens);
uint32_t tokens_crc(const int32_t * ids, size_t n);  // the same over an array (TailOutput payload)
uint32_t bundle_payload_crc(const pb::TensorBundle & bundle);
pb::Checksum crc_checksum(uint32_t value);
// BAD_BUNDLE when a set checksum does not match; nothing to check when unset.
Result verify_checksum(const pb::Checksum & expected, uint32_t actual, const char * what);

// The sampling contract's value ranges (BAD_REQUEST); stop token ids in [0, n_vocab) when
// n_vocab > 0 (else only >= 0).
Result check_sampling(const pb::SamplingParams & s, uint32_t n_vocab = 0);

// Stateless checks of one SessionRequest frame, in three stages that a worker applies in this
// order, with its session-state checks (epoch, step, cache expectation, positions held) between
// the header and the rows. With a capability they also check fingerprint, range, role,
// vocabulary and chunk limits against that Shard. Bundles are checked by Assembler.
//
// 1. the frame kind and header: schema version, fingerprint, range, effective start,
//    compression, phase, cache expectation kind, session id (1..128 bytes), request id (at most
//    128 bytes), route epoch (>= 1). `whole_range`: the Shard runs its whole range
//    (effective_start must be unset or the range start).
Result check_header(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap = nullptr,
                    bool whole_range = false);
// 2. rows: PREFILL/DECODE carry a non-empty position range, DECODE exactly one row, at most the
//    chunk limit; TRUNCATE/RELEASE carry no input (and a payload checksum of nothing).
Result check_rows(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap = nullptr);
// 3. input: sampling (when `sampling_applies`: a tail, or a Shard forwarding it downstream),
//    role (token ids to a head, a bundle otherwise), token count, vocabulary, payload checksum.
Result check_input(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap = nullptr,
                   bool sampling_applies = true);
// All three stages.
Result check_request(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap = nullptr);
// check_request, then (a frame carrying a bundle) the bundle's own rules as one complete step:
// what a golden vector's handling certifies (Assembler limits from the capability's
// max_message_bytes / max_fragment_bytes).
Result check_frame(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap = nullptr);

} // namespace dgr::bundle
