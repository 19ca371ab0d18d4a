// Chained routes (StepFrame.downstream): this worker opens its own Session stream to the next
// Shard (downstream.h), forwards every completed step's boundary rows, and answers its caller
// with what the route's tail answered. The forwarder is the unit that knows the route beyond
// this Shard: it checks an opening frame's hops against this worker and its allowed peers,
// opens a session's link, writes the frame that carries a step down (a full StepFrame, or a
// FastDecodeFrame when nothing but the row changes), and names a failed hop in the errors. It
// keeps no session state of its own (that is ChainState, moved by the scheduler), so
// worker/tests/chain_forwarder_test.cpp checks it without a model or a network.
#pragma once

#include "common/bundle.h"
#include "worker/backend.h"
#include "worker/downstream.h"
#include "worker/session_table.h"
#include "worker/work_queue.h"

#include <cstdint>
#include <string>

namespace dgr::worker {

class ChainForwarder {
public:
    ChainForwarder(const BackendInfo & info, ChainOptions opts) : info_(info), peers_(std::move(opts)) {}

    // The hops of an opening frame: contiguous from this Shard's end to the model's last layer,
    // each with this worker's fingerprint and an allowed peer; an error when not.
    bundle::Result check_hops(const pb::StepFrame & sf) const;
    // Opens `s`'s link to the first hop (the session's ChainState: hops, stages, colocated);
    // the link's replies and end come back through the callbacks (gRPC threads).
    void open(Session & s, const pb::StepFrame & sf, DownstreamLink::OnReply on_reply, DownstreamLink::OnEnd on_end);
    // Whether every hop of a route named by `sf` shares this host.
    bool colocated(const pb::StepFrame & sf) const;

    // The frame that carries step `w`'s boundary rows (taken from `r`) to the next Shard as
    // its step c.step. The link's first frame opens the session there (EMPTY, the rest of the
    // hops, `pipelined`); a DECODE row with nothing else to say goes as a FastDecodeFrame.
    // `hint_rows` > 1: one of that many rows of upstream batch `batch_id` (StepFrame.batch).
    static pb::SessionRequest frame_for(ChainState & c, const Session & s, const Work & w, pb::SessionResponse & r,
                                        bool pipelined, uint32_t hint_rows, uint64_t batch_id);

    // "downstream HOST:PORT [A, B)": how errors of a chained session name the next Shard
    static std::string label(const Session & s);
    // A failure from the session's downstream stream: names the hop in the message and, unless
    // a Shard farther down is named already, in ShardError.failed_endpoint/start/end.
    static void blame(const Session & s, pb::ShardError & e);
    // The reason and message a session gets when its downstream stream ends with `st`:
    // PEER_SILENT when the peer went silent (keepalive, deadline), else UNAVAILABLE.
    static pb::ErrorReason end_reason(const grpc::Status & st);
    static std::string end_message(const grpc::Status & st);

private:
    const BackendInfo & info_;
    mutable ChainPeers peers_;
};

}  // namespace dgr::worker
