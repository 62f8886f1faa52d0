//! The real-server agent's control plane: `inband agent`.

pub mod maps;
