// The float64 instantiation of the decoder, built only for the tests' gradient checks.
#include <chunkloss/model/decoder_impl.h>

namespace chunkloss::model::detail {

template class Decoder<double>;
template void init_parameters<double>(const LlamaConfig&, const std::vector<ParameterInfo>&,
                                      std::uint64_t, std::vector<double>&);

}  // namespace chunkloss::model::detail
