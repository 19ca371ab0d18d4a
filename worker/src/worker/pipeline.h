// Pipeline-aware scheduling of chained routes (docs/worker.md, "Pipelined routes"). Pure
// policy, no state: the scheduler asks it how many groups the decode rows of its chained
// sessions form, how many rows one batch may take, and whether a gather should wait for a
// session whose next row is predicted to arrive at a given time.
//
// Why groups: on a route of S Shards on S hosts, a head that computes every ready session in
// one batch makes the Shards take turns (the head idles while the rows travel down the route and
// back; the tail idles while the head computes). Split into G >= S groups, the head computes
// group B while the next Shard computes group A, and so on: every Shard stays busy once there
// are at least S groups of rows in flight. With server-side generation the groups stay
// staggered by themselves: a group's rows come back together and are computed together.
#pragma once

#include "worker/option_table.h"

#include <chrono>
#include <cstdint>

namespace dgr::worker {

// Largest --pipeline-groups value (the option table's bound).
constexpr uint32_t kMaxPipelineGroups = (uint32_t) option_spec(Opt::kPipelineGroups).max;

// Groups for the sessions of a route of `stages` Shards (this one included). `option` is
// --pipeline-groups: 0 = auto (one group per stage when the route leaves this host, one group
// when every hop is on this host: co-located Shards usually share the cores, so overlapping
// them only slows both), 1 = off (one batch of every ready row, the Shards take turns),
// N >= 2 = N groups whatever the placement.
uint32_t pipeline_groups(uint32_t option, uint32_t stages, bool colocated);

// Rows of chained DECODE steps one batch may take when `active` chained sessions decode in
// `groups` groups: ceil(active / groups); 0 = no cap (one group, or at most one session).
uint32_t pipeline_group_rows(uint32_t active, uint32_t groups);

// The group of a session's rows: the block of `group_rows` consecutive sequence ids its
// sequence falls in. llama.cpp computes a batch of one-stream-per-sequence KV as one ubatch only
// over consecutive sequence ids (a batch of sequences 0, 2, 4, 6 is four ubatches, each as
// slow as a 1-row step: measured 16.4 ms for 2 rows against 7.2 ms for 1 on SmolLM2 0:22), so
// a group is a block of ids, not any rows that happen to be ready.
int64_t pipeline_block(int32_t seq, uint32_t group_rows);

// Gather: wait for a session's next row only when it is predicted to arrive by `deadline`
// (its last answer at `answered` plus the gap it usually takes, an EWMA; gap <= 0: unknown,
// wait). A session of the other pipeline group arrives a whole stage compute later: waiting for
// it until the deadline would only idle this Shard.
bool worth_waiting(std::chrono::steady_clock::time_point answered, double gap_s,
                   std::chrono::steady_clock::time_point deadline);

// Chunked prefill over a pipelined route: a chained Shard splits one PREFILL step of `n` rows
// into pieces and forwards piece i while it computes piece i+1, so the Shards of the route
// overlap on one long prompt too. Returns the rows per piece: n (no split) when `groups` <= 1,
// else ceil(n / (2 * groups)) but at least kMinPrefillPiece rows (smaller pieces cost more
// than the overlap gains on CPUs). With S Shards and k pieces a step takes about k + S - 1
// piece times instead of k * S.
constexpr uint32_t kMinPrefillPiece = 32;
uint32_t prefill_piece_rows(uint32_t n, uint32_t groups);

// Updates the EWMA of a session's answer-to-next-row gap with one observation.
double next_gap(double ewma_s, double observed_s);

}  // namespace dgr::worker
