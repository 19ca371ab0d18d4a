// What a worker serves: the options as its backend allows them, and the capability message
// built from them (scheduler.h).
#include "worker/scheduler.h"

#include <algorithm>

namespace dgr::worker {

SchedulerOptions fit_options(SchedulerOptions o, const BackendInfo & in) {
    if (o.kv_cells == 0 || o.kv_cells > in.kv_cells) o.kv_cells = in.kv_cells;
    o.max_sessions = std::min(o.max_sessions, in.n_seq_max);
    o.max_batch_tokens = std::min(o.max_batch_tokens, in.max_batch_tokens);
    if (o.max_prefill_chunk_tokens + o.max_sessions > o.max_batch_tokens) {
        o.max_prefill_chunk_tokens = o.max_batch_tokens > o.max_sessions ? o.max_batch_tokens - o.max_sessions : 1;
    }
    o.max_session_positions = (uint32_t) std::min<uint64_t>(o.max_session_positions, o.kv_cells);
    return o;
}

pb::GetCapabilityResponse capability_of(const BackendInfo & in, const SchedulerOptions & o) {
    pb::GetCapabilityResponse resp;
    resp.set_schema_version(pb::SCHEMA_VERSION_V1);
    resp.set_min_schema_version(pb::SCHEMA_VERSION_V1);
    auto * id = resp.mutable_identity();
    id->set_artifact_id(in.artifact_id);
    id->set_recipe_json(in.recipe_json);
    id->set_compatibility_fingerprint(in.fingerprint);
    id->mutable_range()->set_start(in.layer_start);
    id->mutable_range()->set_end(in.layer_end);
    id->set_n_layer(in.n_layer);
    id->set_head(in.head);
    id->set_tail(in.tail);
    id->set_n_embd(in.n_embd);
    id->set_n_vocab(in.n_vocab);
    id->set_architecture(in.architecture);
    auto * c = resp.mutable_capacity();
    c->set_max_sessions(o.max_sessions);
    c->set_kv_cells(o.kv_cells);
    c->set_max_session_positions(o.max_session_positions);
    c->set_max_batch_tokens(o.max_batch_tokens);
    c->set_max_prefill_chunk_tokens(o.max_prefill_chunk_tokens);
    c->set_max_message_bytes(o.max_message_bytes);
    c->set_max_fragment_bytes(o.max_fragment_bytes);
    c->add_compressions(pb::COMPRESSION_NONE);
    c->set_server_generation(true);
    c->set_chain_forwarding(true);
    c->set_weight_bytes(in.weight_bytes);
    c->set_kv_bytes(in.kv_bytes);
    c->set_scratch_bytes(in.scratch_bytes);
    c->set_memory_budget_bytes(o.memory_budget_bytes);
    c->set_predicted_memory_bytes(in.predicted_total());
    auto * dev = resp.mutable_device();
    dev->set_backend(in.device.backend);
    dev->set_name(in.device.name);
    dev->set_description(in.device.description);
    dev->set_vendor(in.device.vendor);
    dev->set_driver_version(in.device.driver_version);
    dev->set_architecture(in.device.architecture);
    dev->set_device_class(in.device.device_class);
    dev->set_memory_total_bytes(in.device.memory_total);
    dev->set_memory_free_bytes(in.device.memory_free);
    dev->set_memory_predicted_bytes(in.device.memory_predicted);
    if (in.measured.present) {
        auto * m = resp.mutable_measured();
        for (const auto & b : in.measured.decode) {
            auto * d = m->add_decode();
            d->set_rows(b.rows);
            d->set_step_seconds(b.step_s);
            d->set_step_no_output_seconds(b.step_no_output_s);
        }
        m->set_prompt_seconds_per_token(in.measured.prompt_s_per_token);
        m->set_prompt_no_output_seconds_per_token(in.measured.prompt_no_output_s_per_token);
        m->set_duty(in.measured.duty);
        m->set_threads(in.measured.threads);
        m->set_probe_seconds(in.measured.probe_seconds);
        m->set_from_cache(in.measured.from_cache);
    }
    return resp;
}

}  // namespace dgr::worker
