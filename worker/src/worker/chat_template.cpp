// ApplyChatTemplate: the service handler and the llama.cpp call behind it. Kept apart from
// service.cpp so the template support stays one small unit.
#include "worker/chat_template.h"

#include "worker/errors.h"
#include "worker/llama_backend.h"
#include "worker/service.h"

#include "llama.h"

namespace dgr::worker {

namespace pb = ::dgr::shard::v1;

bool apply_chat_template(const std::string & tmpl, const std::vector<ChatTurn> & turns, bool add_assistant,
                         std::string * out, std::string * error) {
    if (tmpl.empty()) {
        *error = "the model has no chat template (GGUF tokenizer.chat_template is absent); send a plain prompt";
        return false;
    }
    std::vector<llama_chat_message> msgs;
    size_t total = 0;
    msgs.reserve(turns.size());
    for (const auto & t : turns) {
        msgs.push_back({t.role.c_str(), t.content.c_str()});
        total += t.role.size() + t.content.size();
    }
    std::vector<char> buf(2 * total + 1024);
    int32_t n = llama_chat_apply_template(tmpl.c_str(), msgs.data(), msgs.size(), add_assistant, buf.data(),
                                          (int32_t) buf.size());
    if (n > (int32_t) buf.size()) {
        buf.resize((size_t) n);
        n = llama_chat_apply_template(tmpl.c_str(), msgs.data(), msgs.size(), add_assistant, buf.data(),
                                      (int32_t) buf.size());
    }
    if (n < 0) {
        *error = "llama.cpp does not support the model's chat template (not one of its built-in formats)";
        return false;
    }
    out->assign(buf.data(), (size_t) n);
    return true;
}

std::string LlamaBackend::chat_template() const {
    const char * t = llama_model_chat_template(model_->get(), nullptr);
    return t ? std::string(t) : std::string();
}

void ShardService::on_apply_chat_template(grpc::CallbackServerContext * ctx, const pb::ApplyChatTemplateRequest & req,
                                          pb::ApplyChatTemplateResponse * resp, UnaryDone done) {
    auto fail = [&](pb::ErrorReason reason, const std::string & msg) {
        pb::ShardError e = make_error(reason, msg);
        ctx->AddTrailingMetadata("dgr-error-bin", e.SerializeAsString());
        done(status_for(e));
    };
    std::vector<ChatTurn> turns;
    size_t total = 0;
    for (const auto & m : req.messages()) {
        turns.push_back({m.role(), m.content()});
        total += m.role().size() + m.content().size();
    }
    if (turns.empty()) return fail(pb::ERROR_REASON_BAD_REQUEST, "no messages");
    if (total > (1u << 20)) return fail(pb::ERROR_REASON_MESSAGE_TOO_LARGE, "messages above 1 MiB");
    const std::string tmpl = backend_.chat_template();
    std::string text, err;
    if (!apply_chat_template(tmpl, turns, req.add_assistant(), &text, &err)) {
        return fail(pb::ERROR_REASON_BAD_REQUEST, err);
    }
    resp->set_text(text);
    resp->set_template_source(tmpl);
    done(grpc::Status::OK);
}

}  // namespace dgr::worker
