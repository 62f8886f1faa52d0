fn main() {
    inband_bpf_build::skeletons(&["trace"]);
    inband_bpf_build::shared_types(&["trace.h"]);
}
